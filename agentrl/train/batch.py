"""Trajectories -> padded tensors in verl's layout: left-padded prompt, right-padded response.

For ``B`` trajectories with longest prompt ``P`` and longest response ``R``:

- ``input_ids``  [B, P+R] long: ``pad..pad prompt | response pad..pad``
- ``attention_mask`` [B, P+R] long: 1 on real prompt and response tokens
- ``position_ids`` [B, P+R] long: 0.. over real tokens (``cumsum(attention_mask)-1``, clamped at 0)
- ``responses``  [B, R] long: the response ids (model and env tokens)
- ``response_mask`` [B, R] float: 1 on model-sampled tokens (trained), 0 on env tokens and padding
- ``rollout_log_probs`` [B, R] float32: the engine's log-probs (0 where ``response_mask`` is 0)
- ``token_level_rewards`` [B, R] float32: the episode reward on the last model token, 0 elsewhere
- ``index`` [B] long: group id (trajectories sampled for the same task share it)

The log-prob of ``responses[:, t]`` comes from the logits at position ``P - 1 + t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentrl.harmony.trajectory import Trajectory


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    token_level_rewards: torch.Tensor
    index: torch.Tensor

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | Sequence[int]) -> Batch:
        """Rows ``rows`` of every tensor (same padding widths)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return Batch(**{name: getattr(self, name)[idx.to(getattr(self, name).device)] for name in self.__dataclass_fields__})

    def to(self, device: str | torch.device) -> Batch:
        return Batch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


def collate(trajectories: Sequence[Trajectory], group_ids: Sequence[int], pad_token_id: int = 0) -> Batch:
    """Pad ``trajectories`` into a :class:`Batch`. ``group_ids[i]`` is trajectory ``i``'s task group.

    A trajectory without model tokens (e.g. the env failed at reset) is still collated; its mask is
    all zeros so it contributes no gradient. Raises ``ValueError`` on inconsistent trajectories.
    """
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    if len(group_ids) != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories but {len(group_ids)} group ids")
    for t in trajectories:
        t.validate()
        if not t.prompt_ids:
            raise ValueError("trajectory has an empty prompt")
    batch = len(trajectories)
    width_p = max(len(t.prompt_ids) for t in trajectories)
    width_r = max(1, max(len(t.response_ids) for t in trajectories))
    input_ids = torch.full((batch, width_p + width_r), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    response_mask = torch.zeros((batch, width_r), dtype=torch.float32)
    rollout_lp = torch.zeros((batch, width_r), dtype=torch.float32)
    rewards = torch.zeros((batch, width_r), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, width_p - p : width_p] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attention[i, width_p - p : width_p + r] = 1
        if r == 0:
            rewards[i, 0] = float(t.reward)
        else:
            input_ids[i, width_p : width_p + r] = torch.tensor(t.response_ids, dtype=torch.long)
            mask = torch.tensor(t.response_mask, dtype=torch.float32)
            response_mask[i, :r] = mask
            rollout_lp[i, :r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32) * mask
            model_positions = mask.nonzero()
            # the reward sits on the last model token (position 0 if the model never spoke, so that
            # group statistics still see it; the zero mask keeps it out of the loss)
            last = int(model_positions[-1]) if len(model_positions) else 0
            rewards[i, last] = float(t.reward)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        responses=input_ids[:, width_p:].clone(),
        response_mask=response_mask,
        rollout_log_probs=rollout_lp,
        token_level_rewards=rewards,
        index=torch.tensor(list(group_ids), dtype=torch.long),
    )
