"""Downstream evaluation with lm-evaluation-harness (issue #46; docs/evaluation.md): `lm_eval_model`
(the `megatron_moe` backend; importing it needs lm-eval) and `during_training` (evaluation.lm_eval_*
during training; lm-eval imported only when tasks are configured)."""
