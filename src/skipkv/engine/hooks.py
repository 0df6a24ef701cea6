"""Re-export of the steering hook, which lives in `skipkv.steering.hook` (steering sits below the engine).

Kept only so engine modules edited in parallel keep importing; new code imports `skipkv.steering.hook`.
"""

from skipkv.steering.hook import ResidualAdd

__all__ = ["ResidualAdd"]
