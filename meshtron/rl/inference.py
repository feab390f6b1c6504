"""The inference interface of RL: `.generate(prompts, sampling)` -> text, token ids and per-token log
probabilities, from one of several backends.

- `EngineBackend`: the in-process meshtron `LLMEngine` running the trained model itself — the same
  `nn.Module` and parameter tensors, no copy, no conversion. Optimizer steps change the weights in
  place, so the engine's cached keys/values (and its prefix cache) go stale: `suspend()` frees them
  before training and `resume()` starts from an empty cache after.
- `OpenAIBackend`: any OpenAI-compatible `/v1/completions` endpoint (meshtron serve, vLLM); token
  ids come from `return_tokens_as_token_ids`, tempered log probs from meshtron's `logprobs_mode`
  extension (sent only when the temperature is not 0 or 1). It samples whatever weights the server holds.
- `TransformersBackend` (optional): a Hugging Face causal LM's `generate`;
  `MirroredTransformersBackend` keeps such a model a copy of the trained meshtron model.
- `CoordinatorBackend`: data-parallel engines behind `meshtron.inference.coordinator`.
- `TensorParallelEngineBackend`: `EngineBackend` on a tensor-parallel model: the TP group's leader
  runs the engine and the others follow its forwards (`meshtron.inference.tp_serving`).
- `PipelineEngineBackend`: the pipeline-parallel engine (`meshtron.inference.pipeline_engine`) under
  pipeline parallelism: each pp rank holds a copy of its own trained stage; the last stage leads.
`build_backend` makes the one `rl.backend` names. Every backend takes `meshtron.inference.request.SamplingParams`; log probs are those of the
distribution sampled from (temperature applied), the quantity the GRPO ratio needs.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol, Union

import torch
from torch.distributed.tensor import DTensor

from meshtron.inference.request import SamplingParams

Prompt = Union[str, list[int]]


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the completion, including a final end-of-document token when it stopped on one
    log_probs: list[float]  # one per completion token
    text: str
    finish_reason: Optional[str] = None
    routing: Optional[dict] = None  # MoE, engine with record_routing: router name -> (positions, k) expert ids


class InferenceBackend(Protocol):
    def generate(self, prompts: list[Prompt], sampling: Union[SamplingParams, list[SamplingParams]]
                 ) -> list[Generation]: ...

    def suspend(self) -> None: ...  # weights are about to change: drop everything computed from them

    def resume(self) -> None: ...


def _per_prompt(sampling: Union[SamplingParams, list[SamplingParams]], n: int) -> list[SamplingParams]:
    params = sampling if isinstance(sampling, list) else [sampling] * n
    return [replace(p, return_log_probs=True, logprobs_mode="processed") for p in params]


class EngineBackend:
    """Rollouts from an `LLMEngine` built on the trained model (its parameters, not a copy). With
    `record_routing` (MoE models) each generation carries the experts the engine chose for each of
    its positions, for router replay in training (`meshtron.rl.replay`)."""

    def __init__(self, model: torch.nn.Module, tokenizer, config=None, record_routing: bool = False):
        from meshtron.inference.config import EngineConfig
        from meshtron.inference.engine import LLMEngine
        from meshtron.rl.replay import EngineRoutingRecorder, routing_engine_config

        self.model = model
        was_training = model.training
        if record_routing:
            config = routing_engine_config(config or EngineConfig())
        self.engine = LLMEngine(model, tokenizer, config)
        model.train(was_training)
        self.recorder = EngineRoutingRecorder(self.engine, model) if record_routing else None

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        if self.engine.is_suspended:
            self.engine.resume()
        was_training = self.model.training
        self.model.eval()
        recording = self.recorder.recording() if self.recorder is not None else contextlib.nullcontext()
        try:
            with recording:
                outputs = self.engine.generate(list(prompts), _per_prompt(sampling, len(prompts)))
        finally:
            self.model.train(was_training)
        failed = [o for o in outputs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"rollout {failed[0].req_id} failed in the engine: {failed[0].error}")
        gens = [Generation(o.prompt_token_ids, list(o.token_ids), [lp.log_prob for lp in o.log_probs], o.text,
                           o.finish_reason) for o in outputs]
        if self.recorder is not None:
            for o, g in zip(outputs, gens):
                g.routing = self.recorder.routing(o.req_id, len(g.prompt_token_ids) + len(g.token_ids) - 1)
            self.recorder.forget()
        return gens

    def suspend(self) -> None:
        """Free the KV cache and forget the prefix cache (its keys/values came from the old weights)."""
        self.engine.suspend()

    def resume(self) -> None:
        self.engine.resume()


@contextlib.contextmanager
def gathered_logits(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the model's vocabulary-sharded logits come out whole (the engine samples from them)."""
    def gather(module, args, out):
        return out.full_tensor() if isinstance(out, DTensor) else out

    handle = model.register_forward_hook(gather)
    try:
        yield
    finally:
        handle.remove()


class TensorParallelEngineBackend(EngineBackend):
    """`EngineBackend` on a tensor-parallel model (logits sharded over the vocabulary, as the trainer
    wants them): every rank of the `TPGroup` `tp` has an engine on its shard (each caches its own
    heads); the group's leader schedules and samples (logits gathered), announcing each step, on which
    the others run the same forward (`tp_serving.follow`); then it sends them the generations, so every
    rank trains on the same rollouts. The leader records MoE routing (the followers' routers see the
    same inputs). Suspend/resume run on every rank locally (each frees its own shard of the KV cache)."""

    def __init__(self, model: torch.nn.Module, tokenizer, config, tp, record_routing: bool = False):
        super().__init__(model, tokenizer, config, record_routing=record_routing)
        self.tp = tp

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        from meshtron.inference.tp_serving import Leader, follow

        result: Any = None
        if self.tp.is_leader:
            self.engine.step_hook = leader = Leader(self.tp)
            try:
                with gathered_logits(self.model):
                    result = super().generate(prompts, sampling)
            except Exception as e:  # the followers must not wait for generations that never come
                result = RuntimeError(f"tensor-parallel rollout failed on the leader: {type(e).__name__}: {e}")
            finally:
                self.engine.step_hook = None
                leader("stop")
        else:
            self.resume()
            was_training = self.model.training
            self.model.eval()
            try:
                with gathered_logits(self.model):
                    follow(self.engine.runner, self.tp)
            finally:
                self.model.train(was_training)
        result = self.tp.broadcast(result)
        if isinstance(result, Exception):
            raise result
        return result


class OpenAIBackend:
    """Completions from an OpenAI-compatible server, `concurrency` requests at a time."""

    def __init__(self, base_url: str, model: str = "", tokenizer=None, concurrency: int = 16,
                 timeout_s: float = 600.0):
        base = base_url.rstrip("/")
        self.url = base + ("/completions" if base.endswith("/v1") else "/v1/completions")
        self.model, self.tokenizer = model, tokenizer
        self.concurrency, self.timeout_s = concurrency, timeout_s

    def _one(self, prompt: Prompt, p: SamplingParams) -> Generation:
        body = {"model": self.model, "prompt": prompt, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "top_p": p.top_p, "logprobs": 1, "return_tokens_as_token_ids": True}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.top_k:
            body["top_k"] = p.top_k
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.temperature not in (0.0, 1.0):  # the sampled distribution differs from the raw one
            body["logprobs_mode"] = "processed"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            choice = json.loads(response.read())["choices"][0]
        lp = choice.get("logprobs") or {"tokens": [], "token_logprobs": []}
        ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        prompt_ids = prompt if isinstance(prompt, list) else (self.tokenizer.encode(prompt) if self.tokenizer else [])
        return Generation(list(prompt_ids), ids, [float(x) for x in lp["token_logprobs"]], choice["text"],
                          choice.get("finish_reason"))

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        params = _per_prompt(sampling, len(prompts))
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._one, prompts, params))

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass


class TransformersBackend:
    """Sampling with a Hugging Face causal LM (`transformers`, optional); log probs from its logits."""

    def __init__(self, model, tokenizer, eos_token_id: Optional[int] = None):
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eod_id", None)

    @torch.no_grad()
    def _one(self, prompt: Prompt, p: SamplingParams) -> Generation:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        device = next(self.model.parameters()).device
        generator_args = {"do_sample": not p.greedy, "max_new_tokens": p.max_tokens, "output_logits": True,
                          "return_dict_in_generate": True, "eos_token_id": self.eos_token_id,
                          "pad_token_id": self.eos_token_id if self.eos_token_id is not None else 0}
        if not p.greedy:
            generator_args.update(temperature=p.temperature, top_k=p.top_k or None, top_p=p.top_p)
        if p.seed is not None:
            torch.manual_seed(p.seed)
        out = self.model.generate(torch.tensor([ids], device=device), **generator_args)
        new = out.sequences[0, len(ids):].tolist()
        temperature = 1.0 if p.greedy else p.temperature
        log_probs = [float((logits[0].float() / temperature).log_softmax(-1)[t]) for logits, t in zip(out.logits, new)]
        finish = "stop" if new and new[-1] == self.eos_token_id else "length"
        text_ids = new[:-1] if finish == "stop" else new
        return Generation(ids, new, log_probs, self.tokenizer.decode(text_ids), finish)

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        was_training = self.model.training
        self.model.eval()
        try:
            return [self._one(prompt, p) for prompt, p in zip(prompts, _per_prompt(sampling, len(prompts)))]
        finally:
            self.model.train(was_training)

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass


class CoordinatorBackend:
    """Rollouts spread over data-parallel engine workers through a coordinator (round robin)."""

    def __init__(self, address: str, tokenizer=None, timeout_s: float = 600.0):
        from meshtron.inference.coordinator import CoordinatorClient

        self.client, self.tokenizer, self.timeout_s = CoordinatorClient(address, timeout_s), tokenizer, timeout_s

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        payloads = []
        for prompt, p in zip(prompts, _per_prompt(sampling, len(prompts))):
            fields = {k: v for k, v in vars(p).items() if not k.startswith("_")}
            payloads.append({"prompt": prompt, "sampling": fields})
        out = []
        for r in self.client.request_many(payloads, self.timeout_s):
            if r.error:
                raise RuntimeError(f"rollout {r.req_id} failed on {r.worker}: {r.error}")
            res = r.result
            out.append(Generation(res["prompt_token_ids"], res["token_ids"], res["log_probs"], res["text"],
                                  res["finish_reason"]))
        return out

    def suspend(self) -> None:
        self.client.control("SUSPEND")

    def resume(self) -> None:
        self.client.control("RESUME")


class MirroredTransformersBackend(TransformersBackend):
    """`TransformersBackend` on a Hugging Face copy of a meshtron model (the family `guess_family`
    picks), whose weights are copied from the trained model before every `generate`: rollouts always
    come from the current weights, at the price of one copy of the parameters."""

    def __init__(self, model: torch.nn.Module, model_cfg, vocab_size: int, tokenizer):
        import dataclasses

        import transformers

        from meshtron.models.hf.adapter import guess_family

        self.source = model
        cfg = dataclasses.replace(model_cfg, vocab_size=vocab_size, make_vocab_size_divisible_by=1)
        adapter = guess_family(cfg)
        hf_cfg = adapter.to_hf_config(cfg)
        self.maps = adapter.tensor_maps(cfg)
        config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
        hf = transformers.AutoModelForCausalLM.from_config(config).to(next(model.parameters()).device).float()
        super().__init__(hf.eval(), tokenizer)
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the trained weights into the Hugging Face model (exactly: same dtype, same values)."""
        source = self.source.state_dict()
        target = self.model.state_dict()
        for m in self.maps:
            if m.hf in target:
                target[m.hf].copy_(m.to_hf([source[p].detach() for p in m.parts]))

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        self.sync()
        return super().generate(prompts, sampling)


def build_backend(cfg, model: torch.nn.Module, tokenizer, device: torch.device) -> InferenceBackend:
    """The rollout backend `cfg.rl.backend` names, for `model` (the trained one) and a `RunConfig`."""
    from meshtron.config.fields import ConfigError

    rl = cfg.rl
    if rl.backend == "openai":
        return OpenAIBackend(rl.openai_base_url, rl.openai_model, tokenizer)
    if rl.backend == "transformers":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError("rl.backend: transformers needs the 'hf' extra: pip install 'meshtron[hf]'") from None
        from meshtron.models.hf.adapter import ConversionError

        try:
            vocab = model.state_dict()["embedding.weight"].shape[0]  # padded as the model was built
            return MirroredTransformersBackend(model, cfg.model, vocab, tokenizer)
        except ConversionError as e:
            raise ConfigError(f"rl.backend: transformers cannot mirror this model ({e}); use rl.backend=engine") from None
    from meshtron.rl.replay import has_routers

    return EngineBackend(model, tokenizer, engine_config(cfg, device),
                         record_routing=rl.router_replay and has_routers(model))


def engine_config(cfg, device: torch.device):
    """The rollout engine's settings from a `RunConfig`'s rl section."""
    from meshtron.inference.config import EngineConfig

    rl = cfg.rl
    return EngineConfig(block_size=rl.engine_block_size, kv_cache_memory_mb=rl.engine_kv_cache_memory_mb,
                        max_num_seqs=rl.engine_max_num_seqs, max_num_batched_tokens=rl.engine_max_num_batched_tokens,
                        device=device.type, seed=cfg.train.seed)


class PipelineEngineBackend(EngineBackend):
    """Rollouts under pipeline parallelism from the pipeline-parallel engine
    (`meshtron.inference.pipeline_engine`): every pp rank holds an engine stage whose weights are a
    copy of its own trained stage (`stage`, an `InferenceStage`; the trainer copies into it before
    rollouts), never the whole model. `generate` is a collective over the pipeline's ranks: each passes
    its own prompts, the leader (the last stage) generates all of them through the stages and sends
    every rank the generations of its own prompts."""

    def __init__(self, stage, tokenizer, config, *, pp_group, timeout_s: float = 600.0):
        from meshtron.inference.pipeline_engine import member_for_stage

        was_training = stage.training
        self.member = member_for_stage(stage, tokenizer, config, pp_group=pp_group, timeout_s=timeout_s)
        stage.train(was_training)
        self.model, self.engine, self.recorder = stage, self.member.engine, None
        self.messages = self.member.messages

    def generate(self, prompts: list[Prompt], sampling) -> list[Generation]:
        import torch.distributed as dist

        from meshtron.inference.tp_serving import Leader

        params = _per_prompt(sampling, len(prompts))
        everyone: list[Any] = [None] * self.messages.size
        dist.all_gather_object(everyone, (list(prompts), params), group=self.messages.group)
        result: Any = None
        if self.member.is_leader:
            self.engine.step_hook = leader = Leader(self.messages)
            try:
                result = super().generate([p for ps, _ in everyone for p in ps], [s for _, ss in everyone for s in ss])
            except Exception as e:  # the followers must not wait for generations that never come
                result = RuntimeError(f"pipeline-parallel rollout failed on the leader: {type(e).__name__}: {e}")
            finally:
                self.engine.step_hook = None
                leader("stop")
        else:
            was_training = self.model.training
            self.model.eval()
            try:
                self.member.follow()
            finally:
                self.model.train(was_training)
        result = self.messages.broadcast(result)
        if isinstance(result, Exception):
            raise result
        me = self.messages.rank
        start = sum(len(ps) for ps, _ in everyone[:me])
        return result[start:start + len(prompts)]

    def suspend(self) -> None:
        if self.engine is not None:
            self.engine.suspend()
        else:
            self.member.runner.release()  # this stage's KV cache and Mamba states

    def resume(self) -> None:
        if self.engine is not None:
            self.engine.resume()
