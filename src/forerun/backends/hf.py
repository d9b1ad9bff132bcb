"""Generic backend over any transformers causal LM, using its dynamic KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from forerun.backends.base import BackendBase, ForwardOutput, check_forward


class HFBackend(BackendBase):

    def __init__(self, hf_model, *, max_context: int | None = None):
        cfg = hf_model.config
        self.model = hf_model
        self.config = cfg
        self.device = hf_model.device
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.num_layers = getattr(cfg, "num_hidden_layers", 0)
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        self.max_context = min(max_context or limit, limit)
        self._cache = None
        self._len = 0

    @property
    def length(self) -> int:
        return self._len

    def truncate(self, length: int) -> None:
        length = max(0, length)
        if self._cache is not None and length < self._len:
            # A negative argument removes that many tokens, in old and new transformers alike.
            self._cache.crop(-(self._len - length))
        self._len = min(self._len, length)

    def reset(self) -> None:
        self._cache, self._len = None, 0

    def fork(self) -> HFBackend:
        return HFBackend(self.model, max_context=self.max_context)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        pos: int,
        *,
        skip_layers: Sequence[int] = (),
        return_hidden: bool = False,
        last_only: bool = False,
    ) -> ForwardOutput:
        if skip_layers:
            raise ValueError("layer skipping needs the native backend")
        check_forward(self, tokens, pos)
        self.truncate(pos)
        T = tokens.numel()
        if self._cache is None:
            self._cache = DynamicCache()
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            position_ids=torch.arange(pos, pos + T, device=self.device)[None],
            past_key_values=self._cache,
            use_cache=True,
            output_hidden_states=return_hidden,
            logits_to_keep=1 if last_only else 0,
        )
        self._cache = out.past_key_values
        self._len = pos + T
        hidden = out.hidden_states[-1][0] if return_hidden else None
        if hidden is not None and last_only:
            hidden = hidden[-1:]
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)
