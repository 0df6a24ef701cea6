"""KV storage: fixed-capacity slots (`store.KVStore`) and the transformers `Cache` adapter (`slot_cache.SlotCache`)."""

from skipkv.cache.slot_cache import SlotCache
from skipkv.cache.store import KVStore

__all__ = ["KVStore", "SlotCache"]
