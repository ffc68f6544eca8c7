"""Knowledge distillation in stage 1 (docs/algorithms.md, Distillation): the frozen teacher and the loss of one
micro-batch.

With ``--teacher-model`` a micro-batch's loss is ``(1 - a) * CE + a * T^2 * KL(teacher_T || student_T)`` over the
answer tokens (``dschat.losses.distill_sft_loss``); the teacher is a frozen eval engine (sharded under ZeRO-3,
as stage 3's reference is), and stage 1's evaluation (``dschat.evaluation.lm.evaluate_perplexity``) adds the
student's distillation term on the held-out rows, so ``eval.json`` shows whether the student moved towards its
teacher.
"""

from __future__ import annotations

from typing import Any

import torch

from dschat import engine as E
from dschat.config import EngineArgs, KDArgs
from dschat.data.packing import sft_inputs
from dschat.errors import UserError
from dschat.losses import DistillSFTLossOutput, distill_sft_loss
from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_saved_model, same_tokenizer


class Distiller:
    """The teacher of a stage-1 run: loaded by ``load`` (``OneModelStage.prepare``), then ``loss`` per
    micro-batch; ``evaluate_perplexity(..., distiller=)`` adds the distillation term to the evaluation."""

    def __init__(self, kd: KDArgs, engine: EngineArgs, trust_remote_code: bool = False):
        self.kd, self.engine_args, self.trust_remote_code = kd, engine, trust_remote_code
        self.teacher: Any = None
        self.path = ""

    def describe(self) -> str:
        return f" | teacher {self.kd.teacher_model} (kd coef {self.kd.kd_coef:g}, T {self.kd.kd_temperature:g})"

    def load(self, student_path: str, student_tokenizer: Any, dtype: torch.dtype) -> None:
        """Check the teacher's tokenizer against the student's, then build its frozen engine at the student's ZeRO
        stage (offloaded with ``--offload``)."""
        self.path = resolve_saved_model(self.kd.teacher_model)
        tokenizer = load_tokenizer(self.path, self.trust_remote_code)
        if not same_tokenizer(student_tokenizer, tokenizer):
            raise UserError(f"--teacher-model {self.path} and the student {student_path} have different tokenizers "
                            f"({len(tokenizer)} vs {len(student_tokenizer)} tokens, or other ids); distillation "
                            "compares next-token distributions, so both must share one vocabulary")
        model = create_causal_lm(self.path, dtype, trust_remote_code=self.trust_remote_code)
        self.teacher = E.build_eval_engine(model, zero_stage=self.engine_args.zero_stage,
                                           offload=self.engine_args.offload, dtype=dtype)

    def loss(self, student: Any, batch: dict[str, Any]) -> DistillSFTLossOutput:
        """The mixed loss of one SFT micro-batch (``input_ids``, ``attention_mask``, ``labels``; or packed rows)."""
        inputs = {k: v for k, v in sft_inputs(student, batch).items() if k != "labels"}
        logits = student(**inputs, use_cache=False).logits
        with torch.no_grad():
            inputs = {k: v for k, v in sft_inputs(self.teacher, batch).items() if k != "labels"}
            teacher_logits = self.teacher(**inputs, use_cache=False).logits
        return distill_sft_loss(logits, teacher_logits, batch["labels"], self.kd.kd_coef, self.kd.kd_temperature)
