"""Per-token provenance (issue 33, part 1): the policy version of every sampled token, in the record, through the
builder and the env, and from the decode engine across a weight update that lands between decode steps."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentrl.harmony.trajectory import NOT_SAMPLED, SCHEMA_VERSION, Trajectory


def _record(**kw) -> Trajectory:
    base = dict(prompt_ids=[1, 2], response_ids=[5, 6, 7, 8], response_mask=[1, 1, 0, 1],
                rollout_logprobs=[-0.5, -0.25, 0.0, -1.0], policy_version=3)
    return Trajectory(**{**base, **kw})


def test_token_versions_round_trip_and_schema():
    t = _record(token_versions=[3, 4, NOT_SAMPLED, 5])
    t.validate()
    data = json.loads(t.to_json())
    assert data["schema"] == SCHEMA_VERSION == 3 and data["token_versions"] == [3, 4, -1, 5]
    back = Trajectory.from_json(t.to_json())
    assert back.token_versions == [3, 4, -1, 5] and back.versions() == [3, 4, None, 5]


def test_old_records_read_with_the_episode_version():
    data = _record().to_dict()
    data.pop("token_versions")
    data["schema"] = 2
    old = Trajectory.from_dict(data)
    assert old.token_versions is None and old.versions() == [3, 3, None, 3]
    v1 = {"prompt_ids": [1], "response_ids": [4], "response_mask": [1], "rollout_logprobs": [-0.1], "reward": 1.0,
          "metadata": {"global_steps": 7}}
    assert Trajectory.from_dict(v1).versions() == [7]


@pytest.mark.parametrize("versions, message", [
    ([3, 4, NOT_SAMPLED], "3 entries for 4"),
    ([3, 4, 0, 5], "on env tokens"),
    ([3, -1, NOT_SAMPLED, 5], ">= 0 on model tokens"),
])
def test_validate_rejects_bad_versions(versions, message):
    with pytest.raises(ValueError, match=message):
        _record(token_versions=versions).validate()


def _turns(fmt, n):
    """``n`` (completion, observation) pairs of Harmony ids: a commentary message, then a user nudge."""
    from agentrl.harmony.types import Message

    out = []
    for i in range(n):
        completion = fmt.render_completion([Message("assistant", f"step {i}", channel="commentary")])
        out.append((completion, fmt.render_observation([Message("user", "go on")], completion_ids=completion)))
    return out


def test_builder_records_versions_of_each_completion_and_drops_them_when_one_lacks_them():
    from agentrl.harmony import HarmonyFormat, Message, TrajectoryBuilder

    fmt = HarmonyFormat(reasoning_effort="low")
    prompt = fmt.render_prompt([Message("user", "hi")])
    (c0, o0), (c1, _o1) = _turns(fmt, 2)
    b = TrajectoryBuilder(fmt, prompt, episode=True)
    b.add_model(c0, [-0.1] * len(c0), versions=[0] * (len(c0) - 1) + [1])
    b.add_env(o0)
    b.add_model(c1, [-0.2] * len(c1), versions=[2] * len(c1))
    t = b.trajectory
    t.validate()
    assert t.token_versions == [0] * (len(c0) - 1) + [1] + [NOT_SAMPLED] * len(o0) + [2] * len(c1)
    with pytest.raises(ValueError, match="1 policy versions for"):
        TrajectoryBuilder(fmt, prompt, episode=True).add_model(c0, None, versions=[0])
    b = TrajectoryBuilder(fmt, prompt, episode=True)
    b.add_model(c0, None, versions=[0] * len(c0))
    b.add_env(o0)
    b.add_model(c1, None)  # e.g. an endpoint that reports no versions: none are kept for the episode
    assert b.trajectory.token_versions is None
    assert b.trajectory.versions() == [None] * len(b.trajectory.response_ids)  # nor an episode version


def test_decode_engine_stamps_the_version_of_the_weights_each_token_was_sampled_with():
    """A weight update that lands while a request decodes: the tokens before it carry version 0, those after it
    version 1 (the update waits for the running step: it never lands inside one); the weights are the new ones."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.decode.decode_engine import DecodeEngine

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    engine = DecodeEngine(model, seed=1)
    (plain,) = engine.generate_sync([[1, 2]], SamplingParams(max_new_tokens=3))
    assert plain.policy_versions is None  # an engine nobody versions records none
    engine.policy_version = 0
    new = {name: p.detach() + 0.01 for name, p in model.named_parameters() if name.endswith("mlp.up_proj.weight")}

    async def main():
        seen = asyncio.Event()
        sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
        task = asyncio.create_task(engine.generate([[1, 2, 3]], sampling, on_token=lambda i, t: seen.set()))
        await seen.wait()  # some tokens were sampled with version 0
        engine.update_weights(new, version=1)
        (completion,) = await task
        return completion

    completion = asyncio.run(main())
    versions = completion.policy_versions
    assert len(versions) == len(completion.token_ids) == 24
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in new.items())
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        engine.update_weights({"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights({next(iter(new)): torch.zeros(1)})


def _tiny_llama(torch, transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_transformers_engine_takes_an_update_between_two_decode_steps_and_keeps_the_cache():
    """The transformers engine, updated from inside a decode loop (between the steps of tokens 5 and 6): tokens
    0-5 carry version 0 and are those a run without the update samples; tokens 6+ carry version 1, and token 6's
    log-prob is the new weights' on top of the KV cache the old weights computed (kept, not recomputed)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import copy

    from agentrl.engines.base import SamplingParams
    from agentrl.engines.transformers_engine import TransformersEngine

    model = _tiny_llama(torch, transformers)
    old = copy.deepcopy(model)
    new = {name: p.detach() + 0.05 for name, p in model.named_parameters() if name.endswith("mlp.up_proj.weight")}
    prompt, sampling = [1, 2, 3], SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    engine = TransformersEngine(model, seed=1)
    (plain,) = engine.generate_sync([prompt], sampling)
    assert plain.policy_versions is None  # an engine nobody versions records none
    engine.policy_version = 0

    counted = []

    def on_token(row: int, token: int) -> None:  # the sampling thread, between two decode steps
        counted.append(token)
        if len(counted) == 6:
            engine.update_weights(new, version=1)

    (updated,) = engine.generate_sync([prompt], sampling, on_token=on_token)
    assert updated.policy_versions == [0] * 6 + [1] * (len(updated.token_ids) - 6)
    assert updated.token_ids[:6] == plain.token_ids[:6] and updated.logprobs[:6] == plain.logprobs[:6]
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in new.items())

    # reference for token 6: the old weights' cache of prompt + tokens 0-4, then token 5 through the new weights
    ids = torch.tensor([prompt + updated.token_ids[:5]])
    with torch.no_grad():
        cache = old(input_ids=ids, use_cache=True).past_key_values
        logits = model(input_ids=torch.tensor([[updated.token_ids[5]]]), past_key_values=cache,
                       position_ids=torch.tensor([[ids.shape[1]]]), use_cache=True).logits[0, -1].float()
    expected = torch.log_softmax(logits, dim=-1)[updated.token_ids[6]].item()
    assert updated.logprobs[6] == pytest.approx(expected, abs=1e-5)
    with torch.no_grad():  # a recomputed cache (the new weights all along) gives another log-prob
        fresh = model(input_ids=torch.tensor([prompt + updated.token_ids[:6]])).logits[0, -1].float()
    assert abs(torch.log_softmax(fresh, dim=-1)[updated.token_ids[6]].item() - expected) > 1e-4


def test_transformers_engine_update_from_the_event_loop_lands_between_steps():
    """``update_weights`` called on the event loop while ``generate`` decodes in the engine's thread: it waits for
    the running step, so the versions of the request's tokens go 0 then 1, never back; bad names and shapes are
    refused before anything is copied, and ``update_lora`` needs an adapter."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.transformers_engine import TransformersEngine

    model = _tiny_llama(torch, transformers)
    engine = TransformersEngine(model, seed=1)
    engine.policy_version = 0
    new = {name: p.detach() + 0.01 for name, p in model.named_parameters() if name.endswith("mlp.up_proj.weight")}

    async def main():
        seen = asyncio.Event()
        task = asyncio.create_task(engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=24),
                                                   on_token=lambda i, t: seen.set()))
        await seen.wait()  # some tokens were sampled with version 0
        engine.update_weights(new, version=1)
        return await task

    for completion in asyncio.run(main()):
        versions = completion.policy_versions
        assert len(versions) == len(completion.token_ids) and versions[0] == 0 and versions == sorted(versions)
    assert engine.policy_version == 1
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        engine.update_weights({next(iter(new)): torch.zeros_like(new[next(iter(new))]), "nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights({next(iter(new)): torch.zeros(1)})
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    with pytest.raises(ValueError, match="no LoRA adapter"):
        engine.update_lora({}, version=2)
    assert engine.policy_version == 1
