"""trainer.model: the single-device GPT (never imports torch.distributed or trainer.parallel), configured by
the ``model`` section itself (:class:`trainer.config.ModelConfig`).

- :class:`GPT`, :class:`StageSpec`, :func:`build_gpt`, :func:`masked_mean` — trainer.model.gpt.
- :func:`init_weights` — layout-independent init (trainer.model.init).
- :func:`megatron_state_dict` / :func:`load_megatron_state_dict` — Megatron legacy nested layout
  (trainer.model.names).
"""

from trainer.model.gpt import GPT, StageSpec, build_gpt, masked_mean
from trainer.model.init import init_weights, materialize
from trainer.model.names import load_megatron_state_dict, megatron_state_dict

__all__ = ["GPT", "StageSpec", "build_gpt", "init_weights", "load_megatron_state_dict", "masked_mean",
           "materialize", "megatron_state_dict"]
