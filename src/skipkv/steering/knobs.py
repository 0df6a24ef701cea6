"""The steering knobs shared by the `skipkv` and `seal` policies, and the hook they build from them.

    skipkv generate --model M --policy seal --steering v.safetensors --steering-layer 12 --alpha0 -1 "..."

A policy that mixes these in gets `steering_hook(bundle)` (a `ResidualAdd` on the residual input of the chosen
layer, coefficient and gate per request from its `SteerState`) and `check_run` (hidden size, layer range and
evaluation-id overlap against the file). The file's existence and format are checked when the policy is built,
before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.steering.gate import SCOPES, SteerState
from skipkv.steering.vector import SteeringFile


@dataclass(frozen=True)
class SteeringKnobs:
    """Mixed in BEFORE the Policy base (class P(SteeringKnobs, Policy)) so these methods win over its no-ops."""

    steering: str = knob("", "steering vector file (skipkv steer build); empty = no steering")
    steering_layer: int = knob(-1, "decoder layer whose residual input is steered; -1 = the file's best layer", ge=-1)
    alpha0: float = knob(-1.0, "alpha0: steering coefficient (negative pushes away from reflection/transition)")
    steer_scope: str = knob("auto", "steer \\n\\n tokens only inside <think>...</think> (think), always, or auto "
                            "(think when the tokenizer has a <think> token, else always)", choices=SCOPES)

    def _check_steering_file(self) -> None:
        """Cheap checks (file exists, is a steering file, holds the requested layer); no model needed."""
        if self.steering:
            SteeringFile.read_meta(self.steering).resolve_layer(self.steering_layer)

    def _steer_state(self, tables, prompt_ids: list[int]) -> SteerState | None:
        return SteerState(tables, self.steer_scope, prompt_ids, self.alpha0) if self.steering else None

    def coefficient(self, state) -> float:
        """The request's current steering coefficient (subclasses make it adaptive)."""
        return state.steer.alpha

    def check_run(self, bundle, dataset: str | None = None, example_ids: tuple | list = ()) -> None:
        if not self.steering:
            return
        f = SteeringFile.read_meta(self.steering)
        layer = f.resolve_layer(self.steering_layer)
        cfg = bundle.model.config
        if f.hidden_size != cfg.hidden_size:
            raise SkipKVError(f"steering file {self.steering} has hidden size {f.hidden_size}; the model's is "
                              f"{cfg.hidden_size}")
        if not 0 <= layer < cfg.num_hidden_layers:
            raise SkipKVError(f"steering layer {layer} is outside the model's layers [0, {cfg.num_hidden_layers})")
        if dataset is not None and f.meta.get("dataset") == dataset:
            overlap = sorted(set(f.ids) & {str(i) for i in example_ids})
            if overlap:
                raise SkipKVError(f"steering file {self.steering} was built from {len(overlap)} of the evaluated "
                                  f"{dataset} examples (e.g. {overlap[0]}); evaluate other examples or rebuild it")

    def steering_hook(self, bundle):
        if not self.steering:
            return None
        from skipkv.steering.hook import ResidualAdd

        self.check_run(bundle)
        f = SteeringFile.load(self.steering)
        layer = f.resolve_layer(self.steering_layer)
        return ResidualAdd(bundle.model, layer, f.vector(layer), coef=self.coefficient,
                           gate=lambda tok, state: state.steer.gate(tok))
