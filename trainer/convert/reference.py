"""The verification's source side: the merged checkpoint run as Slipway's own GPT (``trainer.model``),
or, for what that model does not implement (erf GeLU of some Megatron-LM runs), a Megatron-math forward.

:class:`MegatronReference` is written directly from the Megatron definitions (``formats.md`` §4:
pre-LayerNorm, per-head [q,k,v] rows, scale 1/sqrt(head_dim), fp32 softmax, GeLU, tied head over the
padded vocab), *not* from the HF model, so a wrong name map, QKV reorder, transpose or TP merge shows up
as a logit difference. Both read the tensors in place (no copy of the model) and run in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainer.convert import names
from trainer.convert.spec import GPTSpec

_LM = "language_model."


class MegatronReference:
    """``logits(ids)`` for a merged Megatron GPT state."""

    def __init__(self, state: dict[str, torch.Tensor], spec: GPTSpec) -> None:
        self.spec = spec
        self.w = {k: v.float() for k, v in state.items()}  # a no-op (no copy) for fp32 weights

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[prefix + ".weight"], self.w[prefix + ".bias"],
                            self.spec.layernorm_epsilon)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w[prefix + ".bias"])

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        s, heads = x.shape[0], self.spec.num_attention_heads
        head_dim = self.spec.hidden_size // heads
        # checkpoint_version >= 2.0 rows are [heads, (q, k, v), head_dim]; older ones were fixed on read.
        qkv = self._linear(x, p + "self_attention.query_key_value").view(s, heads, 3, head_dim)
        q, k, v = (qkv[:, :, j].transpose(0, 1) for j in range(3))  # [heads, s, head_dim]
        scores = q @ k.transpose(1, 2) / math.sqrt(head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        context = (probs @ v).transpose(0, 1).reshape(s, -1)
        return self._linear(context, p + "self_attention.dense")

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        approximate = "tanh" if self.spec.activation == "gelu_new" else "none"
        hidden = F.gelu(self._linear(x, p + "mlp.dense_h_to_4h"), approximate=approximate)
        return self._linear(hidden, p + "mlp.dense_4h_to_h")

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[s] token ids → [s, vocab] fp32 logits (padding columns dropped)."""
        wte = self.w[names.WORD_EMBEDDINGS]
        x = wte[ids] + self.w[names.POSITION_EMBEDDINGS][: ids.shape[0]]
        for i in range(self.spec.num_layers):
            p = f"{names.ENCODER}layers.{i}."
            x = x + self._attention(self._ln(x, p + "input_layernorm"), p)
            x = x + self._mlp(self._ln(x, p + "post_attention_layernorm"), p)
        x = self._ln(x, names.ENCODER + "final_layernorm")
        return (x @ wte.t())[:, : self.spec.vocab_size]


class SlipwayGPTSource:
    """The merged state loaded into ``trainer.model.GPT`` (eager kernels, fp32) without copying it."""

    def __init__(self, state: dict[str, torch.Tensor], spec: GPTSpec) -> None:
        from trainer.config.model import ModelConfig
        from trainer.model import GPT

        cfg = ModelConfig(**spec.model_config(), hidden_dropout=0.0, attention_dropout=0.0)
        with torch.device("meta"):
            self.model = GPT(cfg, padded_vocab_size=spec.padded_vocab_size, kernels="eager")
        # The GPT's flat names are Megatron's without the language_model. prefix; assign=True adopts
        # the merged tensors as parameters instead of copying them.
        flat = {k.removeprefix(_LM): v.float() for k, v in state.items()}
        self.model.load_state_dict(flat, strict=True, assign=True)
        self.model.eval()
        self.vocab_size = spec.vocab_size

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(tokens=ids[None])[0, :, : self.vocab_size].float()


def make_source(state: dict[str, torch.Tensor], spec: GPTSpec) -> SlipwayGPTSource | MegatronReference:
    """Slipway's GPT where it implements the checkpoint's math, else the Megatron-math reference."""
    if spec.activation != "gelu":  # tanh GeLU or SwiGLU: the GPT's own
        return SlipwayGPTSource(state, spec)
    return MegatronReference(state, spec)
