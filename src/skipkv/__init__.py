"""skipkv: batched LLM generation with a compressed KV cache.

    from skipkv import LLM, SamplingParams
    llm = LLM("random:qwen2", policy="rkv", budget=64)
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=20))
"""

from skipkv.errors import SkipKVError
from skipkv.version import __version__

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SkipKVError", "SamplingParams", "generate", "load_model",
           "make_policy", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import skipkv` (and `skipkv --help`) does not pay for torch + transformers.
    if name == "load_model":
        from skipkv.models import load_model

        return load_model
    if name in ("generate", "SamplingParams"):
        from skipkv import engine

        return getattr(engine, name)
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from skipkv import llm

        return getattr(llm, name)
    if name == "make_policy":
        from skipkv.policies import make_policy

        return make_policy
    raise AttributeError(name)
