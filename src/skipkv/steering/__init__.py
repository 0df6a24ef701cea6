"""Steering: vector files, the residual hook and the per-request gate/coefficient (SEAL, SkipKV §4.2).

This package sits below the policies; building a vector generates text, so the build driver lives above the
engine, in `skipkv.eval.steering` (`skipkv steer build`).

    skipkv steer build --model M --dataset math500 --offset 400 --limit 20 --layers 8,12 --out v.safetensors
"""

from skipkv.steering.gate import SCOPES, SteerState
from skipkv.steering.vector import SteeringFile

__all__ = ["SCOPES", "SteerState", "SteeringFile"]
