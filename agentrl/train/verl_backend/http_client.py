"""A verl ``LLMServerClient`` over an OpenAI-compatible token server (vLLM, SGLang, ``agentrl serve model``).

Inside a verl run the agent loops get a client that routes ``generate`` to verl's own rollout replicas
through Ray. :class:`OpenAITokenClient` is a drop-in for that client which sends the same call to any
``/v1/completions`` server that takes token-id prompts and returns token ids and log-probs (the vLLM
``return_token_ids`` extension), so verl's ``AgentLoopWorker`` and any verl agent loop (ours included)
can run against a standalone server: for tests on the CPU, and to debug an agent loop against a model
already being served.

``generate(request_id, prompt_ids=..., sampling_params=...)`` maps verl's sampling dict (``temperature``,
``top_p``, ``top_k`` with -1 = off, ``max_tokens``/``max_new_tokens``, ``stop_token_ids``, ``logprobs``)
onto one completion request and returns verl's ``TokenOutput`` (``log_probs`` only when asked).
Multimodal inputs and ``repetition_penalty != 1`` are refused with ValueError.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from agentrl.engines.client import OpenAIEngine
from agentrl.train.verl_backend.sampling import to_sampling


class OpenAITokenClient(LLMServerClient):
    """verl ``LLMServerClient`` backed by an OpenAI-compatible token server at ``base_url`` (``.../v1``)."""

    def __init__(self, config: Any, base_url: str, *, model: str | None = None, **endpoint_kwargs: Any):
        super().__init__(config=config, load_balancer_handle=None)
        self.engine = OpenAIEngine(base_url=base_url, model=model, **endpoint_kwargs)
        self.default_max_tokens = int(config.actor_rollout_ref.rollout.response_length)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("OpenAITokenClient serves text prompts only (no image, video or audio data)")
        sampling = to_sampling(sampling_params, self.default_max_tokens)
        (completion,) = await self.engine.generate([list(prompt_ids)], sampling)
        return TokenOutput(
            token_ids=list(completion.token_ids),
            log_probs=list(completion.logprobs) if sampling_params.get("logprobs") else None,
            stop_reason="completed",
        )

    async def aclose(self) -> None:
        await self.engine.aclose()
