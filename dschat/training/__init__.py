"""Training runs: the output folder, seeding and loaders (``stage``), the resumable loop every stage uses
(``stage.ResumableLoop``), training states and resume (``resume``), saved HF folders (``checkpoint``), exporting a
state (``export``), one run per folder (``lock``), logs and TensorBoard (``tracking``), the loop of the one-model
stages 1-2 (``one_model``), stage 2's loss (``reward``), stage 1's distillation (``distill``) and the pipelines of
stages (``pipeline``)."""
