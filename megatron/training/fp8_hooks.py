"""The training loop's view of FP8: convert the model, step hook, statistics, checkpoint state.

With FP8 off every method is a no-op, so the loop has no FP8 branches of its own.
"""
from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from megatron.fp8.recipe import Fp8AutohealConfig, Fp8Recipe

logger = logging.getLogger("megatron")


class Fp8Hooks:
    def __init__(self, model: nn.Module, recipe: Optional[Fp8Recipe], amax_group, stats: bool,
                 autoheal: Fp8AutohealConfig = Fp8AutohealConfig(), tp_group=None) -> None:
        self.model = model
        self.amax_group, self.tp_group = amax_group, tp_group
        self.recipe = recipe
        self.log_stats = stats and recipe is not None  # --log-fp8-stats: statistics in the log line and TensorBoard
        self.controller = None  # --fp8-autoheal (megatron/training/fp8_autoheal.py), fed by the same statistics
        self.stats = self.log_stats or (autoheal.enabled and recipe is not None)
        self.converted: list[str] = []
        self.nonfinite_iterations = 0  # skipped steps in which an FP8 layer quantized an inf/NaN (this process)
        if recipe is None:
            return
        from megatron.fp8 import convert_to_fp8, enable_fp8_stats

        self.converted = convert_to_fp8(model, recipe, amax_group=amax_group)
        if autoheal.enabled:
            from megatron.training.fp8_autoheal import Fp8Controller

            self.controller = Fp8Controller(model, autoheal, amax_group, tp_group)
        if self.stats:
            enable_fp8_stats(model, True)

    def set_model(self, model: nn.Module) -> None:
        """The model the hooks act on from now on (a pipeline rank's stage, cut out after the FP8 swap)."""
        self.model = model
        if self.controller is not None:
            self.controller.bind(model)

    @property
    def enabled(self) -> bool:
        return self.recipe is not None

    def after_optimizer_step(self) -> None:
        if self.enabled:
            from megatron.fp8 import fp8_optimizer_step

            fp8_optimizer_step(self.model)

    def nonfinite_layers(self) -> list[str]:
        """After a skipped step: the FP8 tensors (`layer.role`) that held an inf/NaN in that step, in the order
        the step computed them (forward operands in module order, then output gradients in reverse), so the
        first one named is where the non-finite values appeared; the later ones inherited them.

        Reads one small flag per layer from the device: called only when a step was skipped, never per step.
        """
        if not self.enabled:
            return []
        from megatron.fp8 import Fp8Linear
        from megatron.fp8.scaling import ROLE_NAMES, Fp8Role

        forward, backward = [], []
        for name, module in self.model.named_modules():
            if isinstance(module, Fp8Linear):
                flags = module.fp8_step_nonfinite.tolist()
                for role, bad in enumerate(flags):
                    if bad:
                        (backward if role == Fp8Role.GRAD_OUTPUT else forward).append(f"{name}.{ROLE_NAMES[role]}")
        hits = forward + backward[::-1]
        if hits:
            self.nonfinite_iterations += 1
        return hits

    def log_values(self, iteration: int, log_interval: int) -> tuple[dict, str]:
        """FP8 statistics for TensorBoard and the worst layer for the log line, every log interval.

        Called after every iteration. Statistics cost extra passes over every quantized tensor (clipping,
        flushing, inf/NaN counts), so they are recorded only in the iterations whose log line reports them:
        this call switches them on for the next iteration exactly when that one logs. (The first iteration
        of a run records them too: they are on from the start, before any iteration number is known.)
        """
        if not self.enabled:
            return {}, ""
        if self.stats:
            from megatron.fp8 import enable_fp8_stats

            enable_fp8_stats(self.model, (iteration + 1) % log_interval == 0)
        if iteration % log_interval != 0:
            return {}, ""
        values: dict = {"fp8/nonfinite-iterations": self.nonfinite_iterations}
        text = f" fp8 non-finite iterations: {self.nonfinite_iterations:3d} |" if self.nonfinite_iterations else ""
        if not self.stats:
            return values, text
        from megatron.fp8 import collect_fp8_stats, worst_fp8_layer

        stats = collect_fp8_stats(self.model, reset=True)
        if self.controller is not None and self.controller.config.enabled:
            self.controller.step(iteration, stats)
            values["fp8/autoheal-actions"] = self.controller.actions
        if not self.log_stats:
            return values, text
        values.update(stats)
        worst = worst_fp8_layer(values)
        text += f" fp8 worst clipping: {worst[0]} {worst[1]:.2e} |" if worst else ""
        return values, text

    def state(self) -> Optional[dict]:
        if not self.enabled:
            return None
        from megatron.fp8 import fp8_state_dict

        state = fp8_state_dict(self.model, self.recipe)
        if self.controller is not None:
            state["autoheal"] = self.controller.state_dict()
        return state

    def load_state(self, state: Optional[dict], source) -> None:
        if not self.enabled:
            return
        if state is None:
            logger.warning("checkpoint %s has no FP8 state: FP8 scales start fresh", source)
            return
        from megatron.fp8 import load_fp8_state_dict

        load_fp8_state_dict(self.model, self.recipe, state)
        saved = state.get("autoheal")
        if self.controller is None and saved and any(any(v) for v in saved.get("level", {}).values()):
            # Actions of a run with --fp8-autoheal, resumed without it: kept (the run continues as it was), no new
            # ones taken. A controller that never steps applies them (the Smooth-SwiGLU ones live on the model).
            from megatron.training.fp8_autoheal import Fp8Controller

            ladder = saved.get("ladder", {})
            frozen = Fp8AutohealConfig(actions=tuple(ladder.get("actions", ("margin",))),
                                       max_margin=int(ladder.get("max_margin", Fp8AutohealConfig.max_margin)))
            self.controller = Fp8Controller(self.model, frozen, self.amax_group, self.tp_group)
            logger.warning("checkpoint %s holds %d FP8 controller action(s) (--fp8-autoheal): kept; add "
                           "--fp8-autoheal to let it act further", source, int(saved.get("actions", 0)))
        if self.controller is not None:
            self.controller.load_state_dict(saved or {})
