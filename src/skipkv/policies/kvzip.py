"""KVzip (Kim et al., NeurIPS 2025, arXiv 2505.23416): query-agnostic compression of the prompt by context
reconstruction.

    skipkv generate --model random:qwen2 --policy kvzip --budget 32 "a long prompt ..."

Once the prompt (the context) is prefilled, the model is fed a reconstruction input per chunk of `chunk_size`
prompt tokens: "\\n\\nRepeat the previous context exactly." (later chunks: "...the part of the previous context
exactly, starting with " and the previous chunk's last `overlap` tokens), the chat template's end of the user turn
and start of the assistant's, then the chunk itself. Each reconstruction token attends to the cached prompt and
to the reconstruction's tokens up to itself, at its true position (right after the prompt). A cached entry
(layer l, kv head h, prompt position j) scores the MAX, over every reconstruction query and the G query heads of
kv head h, of the softmax probability it gets; the lowest are evicted and the reconstruction's own entries are
never kept. The probabilities are the reconstruction forward's own: the grouped attention records each layer's
max as it computes its softmax (attention.StepContext.max_probs), so no second q.k is computed for the score.
About 2-3x the prefill's cost; the last prompt's scores are kept, so the branches of one shared prefill (two
budgets of a grid, `share_prefill`) reconstruct it once. An 8K needle (0.5B, fp32, quiet 2-core AMD EPYC Zen 3):
the first budget's compression took 207 s and the second ~1 s (before: 484 s each, a second q.k for the score
and whole 2,000-query forwards; see RECON_BLOCK_BYTES for the memory), the whole run's peak RSS 11.4 GB.

Selection (`allocation`): `model` (default), one top-k over every (layer, kv head) of the model, `budget` x layers
x kv heads entries, so layers and heads keep different counts: KVzip's default (one threshold over all layers and
heads, attention/score.py `_threshold`; kvpress `layerwise=False`); `layer`, one top-k per layer over its heads
(kvpress `layerwise=True`); `head`, every kv head keeps `budget` (KVzip's uniform head budgets,
`_threshold_uniform`). All three run on the head-split store (cache/store.py), so a head that keeps fewer entries
holds fewer bytes (the reference repos mask or pad them).

Engine integration: at the prefill compression (`select_model_wide`, one request at a time), each chunk's
reconstruction runs through the HF model (`Observation.model`) and the skipkv attention backend over a temporary
one-slot store holding COPIES of the request's prompt entries, every layer, plus room for the chunk, dropped
when the chunk is scored. These transient copies (the prompt's K/V in every layer, and the chunk's) live outside the
slot store, so KV memory admission (engine/memory.py, from `head_capacity`/`head_prefill_keep`) counts the store
truthfully and leaves them out: they are like activations, freed before the request decodes.

Choices and departures (references: snu-mllab/KVzip model/wrapper.py and attention/score.py; kvpress
kvzip_press.py):
- the context is the request's whole prompt; its first `sink` (4, kvpress's n_sink) and newest `window` (1)
  entries are kept whatever they score (the shared sink/window convention; KVzip instead never evicts a system
  prompt it prefilled apart, and kvpress gives the sink score 1 and protects no window: the engine keeps at least
  one newest token);
- the instruction continues the prompt as the open user turn's content, then the template's turn suffix
  (kvpress's layout: the text after a user message's content, e.g. "<|im_end|>\\n<|im_start|>assistant\\n"; "\\n"
  for `template` plain or a tokenizer without a chat template). A prompt that already closed its turn gets the
  same tokens after it;
- each query's softmax runs over EVERY key it attends to (the whole prompt and the reconstruction so far), and an
  entry's score is the max over every chunk's queries. With one chunk (prompts up to `chunk_size` tokens) this is
  the reference's score exactly; with several, the references softmax over the sink, the chunk being repeated and
  the repeat only, and score each chunk from its own reconstruction;
- exact top-k (ties to the older token, then the lower head and layer) instead of the reference's threshold
  (which evicts every entry tied at it); the budget is a token count per kv head, not a ratio;
- prefill only (`phase` prefill): KVzip compresses the context once and generated tokens are all kept; the whole
  prompt at once, so chunked prefill (`--prefill-chunk`) is refused with a one-line error;
- the reconstruction runs in the model's dtype (the score in fp32, fp64 for fp64 models), one request and one
  chunk at a time; the reference scores in the model's dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from skipkv.attention import StepContext
from skipkv.cache import KVStore, SlotCache
from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.models.patches import is_routed, routed
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.policies.laprox import model_wide_select

REPEAT = "\n\nRepeat the previous context exactly."
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with "
NO_MASKS = {"full_attention": None, "sliding_attention": None}  # the skipkv backend builds its own masks
_CONTENT = "KVZIP_USER_CONTENT"


def turn_suffix(tokenizer: Any, template: str) -> str:
    """The text after a user message's content in the chat template (the end of the user turn and the start of
    the assistant's), or "\\n" (`template` plain, or no chat template)."""
    if template == "plain" or getattr(tokenizer, "chat_template", None) is None:
        return "\n"
    text = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    return text.split(_CONTENT, 1)[1]


def reconstruction_inputs(prompt_ids: list[int], tokenizer: Any, template: str, chunk_size: int,
                          overlap: int) -> list[list[int]]:
    """The token ids of each reconstruction forward, one per `chunk_size` prompt tokens (module docstring)."""
    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    suffix = enc(turn_suffix(tokenizer, template))
    out = []
    for c0 in range(0, len(prompt_ids), chunk_size):
        head = enc(REPEAT) if c0 == 0 else enc(REPEAT_PART) + list(prompt_ids[max(0, c0 - overlap):c0])
        out.append(head + suffix + list(prompt_ids[c0:c0 + chunk_size]))
    return out


# fp32 logits of one reconstruction forward's attention per layer, at most. The grouped attention holds Hq x
# queries x keys of them (and their masked copy and softmax): an 8K prompt's whole 2,000-token chunk made 1.1 GB
# each, and with whole chunks the process outgrew 23.5 GiB and was OOM-killed (a 3,000-token prompt: 12.8 GB peak
# before this change, which also recomputed q.k for the score; 4.4 GB after, 100 -> 60 s, /tmp probe). A chunk
# therefore runs as several forwards of fewer queries over the same cache (each query still sees the prompt and
# the reconstruction up to itself: the same attention).
RECON_BLOCK_BYTES = 128 << 20


def reconstruct(model: Any, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                ids: list[int], plan: Any = None) -> list[torch.Tensor]:
    """Feed `ids` (T tokens, positions start..start+T-1) through `model` over a temporary one-slot store holding
    copies of keys/values [1, H, P, D] per layer, in forwards of at most RECON_BLOCK_BYTES of logits. Returns per
    layer [H, P]: the most probability each prompt entry got from any of the T queries and the kv head's query
    heads, each query's softmax over the prompt and the reconstruction up to itself (the forwards' own attention,
    attention.StepContext.max_probs), under the model's kernel `plan` (plan.py; None: its dtype's and device's
    now). The store goes when this returns."""
    L, (_, H, P, D), T = len(keys), keys[0].shape, len(ids)
    device, dtype = keys[0].device, keys[0].dtype
    store = KVStore(L, 1, H, D, P + T, dtype, device)
    for l in range(L):
        store.k[l][:, :, :P] = keys[l]
        store.v[l][:, :, :P] = values[l]
    store.lengths[:, 0] = P
    cache = SlotCache(store)
    logit_bytes = model.config.num_attention_heads * (P + T) * torch.promote_types(dtype, torch.float32).itemsize
    step = max(1, RECON_BLOCK_BYTES // logit_bytes)
    best: list[torch.Tensor] = []
    # The engine compresses inside its own backend block; a policy driven otherwise gets one for this forward.
    with contextlib.nullcontext() if is_routed(model) else routed(model), torch.no_grad():
        for t0 in range(0, T, step):
            n = min(step, T - t0)
            pos = torch.arange(start + t0, start + t0 + n, device=device)[None]
            cache.bind(0, pos)
            ctx = StepContext(store, 0, torch.tensor([n]), pos, max_probs={}, plan=plan)
            model.model(input_ids=torch.tensor([ids[t0:t0 + n]], device=device), position_ids=pos,
                        attention_mask=NO_MASKS, cache=cache, use_cache=True, skipkv_ctx=ctx)
            store.advance(0, torch.tensor([n]))
            probs = ctx.max_probs or {}
            if sorted(probs) != list(range(L)):
                raise SkipKVError(f"kvzip: the reconstruction's attention reported {len(probs)} of {L} layers (it "
                                  "needs the grouped attention over a uniform store)")
            got = [torch.cat(probs[l])[0, :, :P] for l in range(L)]
            best = got if not best else [torch.maximum(a, b) for a, b in zip(best, got)]
    return best


def _fingerprint(model: Any, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                 inputs: list[list[int]]) -> tuple:
    """What the scores depend on: the model object, the reconstruction inputs (they hold the whole prompt), where
    they start, and the cached entries (their shapes and sums: another model's or weights' entries differ)."""
    sums = tuple(float(t.sum(dtype=torch.float64)) for t in (*keys, *values))
    return (id(model), start, tuple(map(tuple, inputs)), tuple(k.shape for k in keys), sums)


# The last prompt's scores, (fingerprint, per layer [H, P]): a shared prefill's branches (budgets) score it once.
_LAST: list[tuple[tuple, list[torch.Tensor]]] = []


@dataclass(frozen=True)
class KVzipState:
    inputs: list[list[int]]  # the reconstruction forwards' token ids, one per chunk of the prompt


@POLICIES.register("kvzip")
@dataclass(frozen=True)
class KVzip(Policy):
    paper = "KVzip (arXiv 2505.23416)"
    keeps = ("`sink` + newest `window` + the prompt entries that get the most attention (max over queries and the "
             "kv head's query heads) while the model reconstructs the prompt (\"Repeat the previous context "
             "exactly.\", then the prompt, in chunks); one top-k over every layer and kv head (`allocation`); "
             "prefill only, whole prompt, ~2-3x the prefill's compute")

    window: int = knob(1, "newest prompt tokens always kept", ge=1)
    sink: int = knob(4, "oldest prompt tokens always kept (kvpress's n_sink)", ge=0)
    phase: str = knob("prefill", "when compression runs (KVzip compresses the prompt once)", choices=("prefill",))
    allocation: str = knob("model", "one top-k over every layer and kv head (model, KVzip's default), per layer "
                           "over its heads (layer, kvpress layerwise), or `budget` per kv head (head)",
                           choices=("model", "layer", "head"))
    chunk_size: int = knob(2000, "prompt tokens reconstructed per forward (KVzip's 2000)", gt=0)
    overlap: int = knob(8, "tokens of the previous chunk quoted in a later chunk's instruction", ge=0)
    template: str = knob("auto", "after the instruction: the chat template's turn suffix if the tokenizer has one "
                         "(auto), or a newline (plain)", choices=("auto", "plain"))

    model_wide: ClassVar[bool] = True
    chunked_prefill: ClassVar[bool] = False

    @property
    def head_split(self) -> bool:
        return True

    def units_per_selection(self, num_layers: int, num_kv_heads: int) -> int:
        """(layer, kv head) units that share one top-k."""
        return {"model": num_layers * num_kv_heads, "layer": num_kv_heads, "head": 1}[self.allocation]

    def head_prefill_keep(self, num_layers: int, num_kv_heads: int, prompt_len: int, prefix_len: int) -> list[int]:
        # A unit keeps at most its selection's total less what the others keep at least (their sink and window).
        u = self.units_per_selection(num_layers, num_kv_heads)
        most = self.budget * u - (u - 1) * min(prefix_len, self.sink + self.window)
        return [most] * (num_layers * num_kv_heads)

    def head_capacity(self, num_layers: int, num_kv_heads: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        keep = self.head_prefill_keep(num_layers, num_kv_heads, prompt_len, prompt_len)
        return [min(prompt_len, k) + max_new_tokens for k in keep]

    def should_compress(self, length: int, is_prefill: bool, state: object | None = None) -> bool:
        return is_prefill and length > self.budget

    def init_state(self, prompt_ids: list[int], tokenizer: Any) -> KVzipState:
        return KVzipState(reconstruction_inputs(list(prompt_ids), tokenizer, self.template, self.chunk_size,
                                                self.overlap))

    def unit_scores(self, obs: list[Observation]) -> list[torch.Tensor]:
        """Every (layer, kv head) unit's scores [n] (layer-major): the reconstruction's max attention."""
        H = sum(1 for o in obs if o.layer == obs[0].layer)
        model, states = obs[0].model, obs[0].states
        if model is None or not states or not isinstance(states[0], KVzipState):
            raise SkipKVError("kvzip runs its reconstruction through the engine's model (Observation.model) from "
                              "the request's state (init_state)")
        if len({o.keys.shape[2] for o in obs}) > 1:
            raise SkipKVError("kvzip scores the whole prompt once; its heads already hold different counts (was "
                              "the prompt prefilled in chunks?)")
        layers = [obs[i:i + H] for i in range(0, len(obs), H)]
        keys = [torch.cat([o.keys for o in units], dim=1) for units in layers]  # [1, H, P, D] copies
        values = [torch.cat([o.values for o in units], dim=1) for units in layers]
        start = int(obs[0].positions.max()) + 1  # the reconstruction follows the prompt
        key = _fingerprint(model, keys, values, start, states[0].inputs)
        if _LAST and _LAST[0][0] == key:
            scores = _LAST[0][1]
        else:
            scores = []
            for ids in states[0].inputs:
                got = reconstruct(model, keys, values, start, ids, obs[0].plan)
                scores = got if not scores else [torch.maximum(a, b) for a, b in zip(scores, got)]
            _LAST[:] = [(key, scores)]
        return [s[h] for s in scores for h in range(H)]

    def select_model_wide(self, obs: list[Observation]) -> list[torch.Tensor] | None:
        """obs: every (layer, kv head) unit of one request, layer-major. One top-k per `allocation` group."""
        H = sum(1 for o in obs if o.layer == obs[0].layer)
        u = self.units_per_selection(len(obs) // H, H)
        if sum(o.keys.shape[2] for o in obs) <= self.budget * len(obs):
            return None
        scores = self.unit_scores(obs)
        keeps: list[torch.Tensor] = []
        for i in range(0, len(obs), u):
            keep = model_wide_select(scores[i:i + u], self.budget * u, self.sink, self.window, 0)
            keeps += keep if keep is not None else [torch.arange(s.numel(), device=s.device) for s in scores[i:i + u]]
        return [k[None, None, :] for k in keeps]
