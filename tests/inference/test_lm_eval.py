"""EleutherAI's lm-evaluation-harness as a real client of the server (issue 17). A tiny random Llama is
built by transformers from a config (with a character-level tokenizer directory that both sides load
offline), converted to a meshtron checkpoint and served on 127.0.0.1; lm-eval scores it through
`local-completions` on a multiple-choice task (loglikelihood), a perplexity task
(loglikelihood_rolling) and a generate_until task, and through `local-chat-completions` on a chat
task. Local tasks: the jsonl files beside this file, task YAMLs written per run. Every log-likelihood
lm-eval computed equals the sum of transformers' log-softmax over the same token ids on the same
weights (within 1e-4), its is_greedy transformers' argmax, and every generation transformers' greedy
output. All four share one in-thread server (seconds each); the documented command lines, a
`meshtron serve` process and the `lm_eval` CLI (whose start-up indexes every task it ships), are slow."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.models.hf import hf_to_meshtron
from meshtron.testing.multiprocess import free_port
from tests.inference.helpers import wait_ready
from tests.inference.server_helpers import live_server
from tests.models.hf.pin import import_transformers

lm_eval = pytest.importorskip("lm_eval")
transformers = import_transformers()

DATA = Path(__file__).with_name("lm_eval")
PINNED = "0.4.13"  # pyproject.toml's dev extra; the request shapes asserted here are this version's
MAX_LEN = 256  # the server's --max-model-len and lm-eval's max_length
ATOL = 1e-4
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
TASKS = {
    "meshtron_mc": {"output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
                    "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "meshtron_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]},
    "meshtron_gen": {"output_type": "generate_until", "doc_to_text": "Q: {{question}}\nA:", "doc_to_target": "{{answer}}",
                     "generation_kwargs": {"until": ["\n\n", "Q:"], "max_gen_toks": 24, "do_sample": False,
                                           "temperature": 0},
                     "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
    "meshtron_chat": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 24, "do_sample": False, "temperature": 0},
                      "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
}
DATA_FILES = {"meshtron_mc": "mc.jsonl", "meshtron_ppl": "ppl.jsonl", "meshtron_gen": "gen.jsonl",
              "meshtron_chat": "chat.jsonl"}


def test_the_pinned_version_is_installed():
    assert lm_eval.__version__ == PINNED, f"pyproject.toml pins lm-eval[api]=={PINNED}; pip install -e '.[dev]'"


def write_tokenizer(directory: Path) -> None:
    """One token per character, an end token and a chat template: loadable by meshtron's hf tokenizer
    and by transformers' AutoTokenizer (lm-eval's tokenizer_backend=huggingface), both offline."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([EOS])
    tok.decoder = decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))


def write_tasks(directory: Path, cache_dir: Path) -> None:
    directory.mkdir()
    for name, spec in TASKS.items():
        files = {"test": str(DATA / DATA_FILES[name])}
        task = {"task": name, "dataset_path": "json", "test_split": "test",
                "dataset_kwargs": {"data_files": files, "cache_dir": str(cache_dir)}, **spec}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(task))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """-> dict: hf (the transformers directory, also the tokenizer's), ckpt, tasks, model, tokenizer."""
    root = tmp_path_factory.mktemp("lm_eval")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    write_tokenizer(hf_dir)
    config = transformers.LlamaConfig(vocab_size=len(CHARS) + 1, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=MAX_LEN, initializer_range=0.2,
                                      bos_token_id=None, eos_token_id=len(CHARS), pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    hf_to_meshtron(hf_dir, root / "ckpt")
    write_tasks(root / "tasks", root / "datasets")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    return {"hf": hf_dir, "ckpt": root / "ckpt", "tasks": root / "tasks", "model": model, "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def server(tiny):
    """-> (base url, served model name): `meshtron serve`'s server in a thread."""
    engine = LLMEngine.from_checkpoint(str(tiny["ckpt"]), EngineConfig(max_model_len=MAX_LEN))
    with live_server(engine) as (url, _, _):
        yield url, engine.model_name


def evaluate(server, tiny, task: str, chat: bool = False, **model_args) -> list[dict]:
    """lm-eval's simple_evaluate on one task -> its logged samples."""
    from lm_eval.tasks import TaskManager

    url, name = server
    if chat:  # the server applies the chat template; lm-eval sends the messages
        args = {"base_url": f"{url}/v1/chat/completions", "model": name, "max_length": MAX_LEN}
    else:
        args = {"base_url": f"{url}/v1/completions", "model": name, "max_length": MAX_LEN,
                "tokenizer_backend": "huggingface", "tokenizer": str(tiny["hf"])}
    results = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions", model_args={**args, **model_args},
        tasks=[task], task_manager=TaskManager(include_path=str(tiny["tasks"]), include_defaults=False),
        log_samples=True, apply_chat_template=chat)
    samples = results["samples"][task]
    assert samples, f"lm-eval logged no samples for {task}"
    return samples


# ---- transformers' side ------------------------------------------------------------------------

@torch.no_grad()
def hf_score(model, ids: list[int], first: int) -> tuple[float, bool]:
    """Sum of log p(ids[p] | ids[:p]) over p >= first, and whether each such token is the argmax."""
    log_probs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    positions = range(first, len(ids))
    total = sum(float(log_probs[p - 1, ids[p]]) for p in positions)
    return total, all(int(log_probs[p - 1].argmax()) == ids[p] for p in positions)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.no_grad()
def hf_greedy_text(model, tokenizer, ids: list[int], max_new: int, stops: list[str]) -> str:
    """transformers' greedy continuation (full recompute), decoded without its end token and cut at
    the first stop string, as an OpenAI server answers."""
    out: list[int] = []
    for _ in range(max_new):
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
    text = tokenizer.decode(out)
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[:min(cuts)] if cuts else text


# ---- the tests ---------------------------------------------------------------------------------

def test_multiple_choice_loglikelihoods_equal_transformers(server, tiny):
    """loglikelihood requests (echo, logprobs=1, max_tokens=1, token-id prompts; four per request
    with batch_size=4): each choice's log-likelihood and is_greedy, and the accuracy."""
    samples = evaluate(server, tiny, "meshtron_mc", batch_size=4)
    model, tok = tiny["model"], tiny["tokenizer"]
    correct, worst = 0, 0.0
    for sample in samples:
        scores = []
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"]):
            ctx = encode(tok, context)
            ref, ref_greedy = hf_score(model, ctx + encode(tok, continuation), len(ctx))
            assert ll == pytest.approx(ref, abs=ATOL) and greedy == ref_greedy, (context, continuation)
            scores.append(ref)
            worst = max(worst, abs(ll - ref))
        correct += max(range(len(scores)), key=scores.__getitem__) == sample["target"]
        assert sample["acc"] == float(max(range(len(scores)), key=scores.__getitem__) == sample["target"])
    assert len(samples) == 8 and worst < ATOL and correct < len(samples)  # a random model: not all right


def test_perplexity_loglikelihoods_equal_transformers(server, tiny):
    """loglikelihood_rolling: the whole text scored after the end token (one window each)."""
    samples = evaluate(server, tiny, "meshtron_ppl")
    model, tok = tiny["model"], tiny["tokenizer"]
    for sample in samples:
        text = sample["doc"]["text"]
        ids = [tok.eos_token_id, *encode(tok, text)]
        assert len(ids) < MAX_LEN - 2  # one window, as the reference assumes
        ((ll,),) = sample["resps"]
        assert ll == pytest.approx(hf_score(model, ids, 1)[0], abs=ATOL), text
    assert len(samples) == 6


def test_generate_until_equals_transformers_greedy(server, tiny):
    samples = evaluate(server, tiny, "meshtron_gen")
    model, tok = tiny["model"], tiny["tokenizer"]
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        expected = hf_greedy_text(model, tok, encode(tok, context), gen_kwargs["max_gen_toks"], gen_kwargs["until"])
        assert sample["resps"][0][0] == expected, context
    assert len(samples) == 6 and any(s["resps"][0][0] for s in samples)  # not all empty


def test_chat_generate_until_equals_transformers_greedy(server, tiny):
    """local-chat-completions: the server renders the tokenizer's chat template, as transformers does."""
    samples = evaluate(server, tiny, "meshtron_chat", chat=True)
    model, tok = tiny["model"], tiny["tokenizer"]
    for sample in samples:
        prompt, gen_kwargs = sample["arguments"][0]
        prompt = getattr(prompt, "prompt", prompt)
        messages = json.loads(prompt[0] if isinstance(prompt, (tuple, list)) else prompt)  # lm-eval may log a 1-tuple
        ids = encode(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        expected = hf_greedy_text(model, tok, ids, gen_kwargs["max_gen_toks"], gen_kwargs["until"])
        assert sample["resps"][0][0] == expected, messages
    assert len(samples) == 5 and any(s["resps"][0][0] for s in samples)


@pytest.mark.slow
def test_the_documented_command_lines(tiny, tmp_path):
    """docs/evaluation.md's commands: `meshtron serve` and the `lm_eval` CLI, each its own process."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "meshtron", "serve", "--checkpoint", str(tiny["ckpt"]),
                              "--port", str(port), "--model-name", "tiny", "--max-model-len", str(MAX_LEN),
                              "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", serve)
        model_args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=tiny,tokenizer_backend=huggingface,"
                      f"tokenizer={tiny['hf']},max_length={MAX_LEN}")
        lm_eval_cli = Path(sys.executable).with_name("lm_eval")
        run = subprocess.run([str(lm_eval_cli), "run", "--model", "local-completions", "--model_args", model_args,
                              "--tasks", "meshtron_mc", "--include_path", str(tiny["tasks"]), "--log_samples",
                              "--output_path", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    (found,) = list((tmp_path / "out").rglob("samples_meshtron_mc_*.jsonl"))
    samples = [json.loads(line) for line in found.read_text().splitlines()]
    model, tok = tiny["model"], tiny["tokenizer"]
    for sample in samples:
        for arguments, resps in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            ctx = encode(tok, context)
            ref, _ = hf_score(model, ctx + encode(tok, continuation), len(ctx))
            assert float(resps[0][0]) == pytest.approx(ref, abs=ATOL)
    assert len(samples) == 8
