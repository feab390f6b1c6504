"""jsonl validation (issue 16): a value at --json-key that is not a string, or a string holding a lone
surrogate, is refused with the file and line, also when a worker of a parallel run meets it mid-file."""

from __future__ import annotations

import json

import pytest

from meshtron.data.documents import iter_documents
from meshtron.data.preprocess import PreprocessOptions, preprocess
from meshtron.data.tokenizer import build_tokenizer, tokenizer_config_for

BAD_VALUES = [(None, "null"), (123, "a number"), (1.5, "a number"), (True, "a boolean"), (["a"], "a list"),
              ({"a": 1}, "an object")]


def jsonl_with(path, bad_line: str, at: int, num_lines: int = 120):
    """num_lines lines of text (one blank, one escaped surrogate pair), `bad_line` as line `at` (1-based)."""
    lines = [json.dumps({"text": f"document {k} " + "x" * (k % 17)}) for k in range(num_lines)]
    lines[3] = ""                                  # blank lines are skipped but still counted
    lines[5] = '{"text": "a valid pair \\ud83d\\ude00 is text"}'
    lines[at - 1] = bad_line
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_line_number_matches_a_naive_count(tmp_path):
    from meshtron.data.documents import line_number

    path = jsonl_with(tmp_path / "a.jsonl", '{"text": "ok"}', 9)
    data = path.read_bytes()
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]
    assert [line_number(str(path), s) for s in starts] == list(range(1, len(starts) + 1))


@pytest.mark.parametrize("value,kind", BAD_VALUES)
def test_non_string_values_are_refused_with_file_and_line(tmp_path, value, kind):
    """Old behaviour: stored as the strings "None", "123", "['a']"... and tokenized."""
    path = jsonl_with(tmp_path / "a.jsonl", json.dumps({"text": value, "id": 7}), 44)
    with pytest.raises(ValueError, match=rf"{path} line 44: 'text' is {kind}, not a string"):
        list(iter_documents([str(path)]))


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("bad_line,message", [
    ('{"text": null}', "'text' is null, not a string"),
    ('{"text": "before \\ud800 after"}', "'text' holds a lone surrogate U\\+D800 at character 7"),
    ('{"text": "low half alone \\udc00"}', "lone surrogate U\\+DC00"),
    (b'{"text": "raw bytes \xed\xa0\x80"}'.decode("utf-8", "surrogateescape"), "lone surrogate U\\+D800"),
    ('{"text": [1, 2]', "is not valid JSON"),
])
def test_parallel_preprocess_names_the_line(tmp_path, bad_line, message, num_workers):
    """Small shards put the bad line in the middle of a later shard: the worker reading it starts
    mid-file, yet the error names the line of the whole file."""
    path = tmp_path / "in.jsonl"
    if "\udca0" in bad_line:      # write the raw (CESU-8) bytes of a surrogate, as some exporters do
        lines = jsonl_with(path, '{"text": "placeholder"}', 97).read_bytes().split(b"\n")
        lines[96] = bad_line.encode("utf-8", "surrogateescape")
        path.write_bytes(b"\n".join(lines))
    else:
        jsonl_with(path, bad_line, 97)
    opts = PreprocessOptions([str(path)], str(tmp_path / "out"), tokenizer_config_for("byte"),
                             num_workers=num_workers, shard_bytes=300, progress=False)
    with pytest.raises(ValueError, match=rf"{path} line 97(:| ).*{message}"):
        preprocess(opts)
    assert not (tmp_path / "out.bin").exists()


def test_valid_file_round_trips_with_its_surrogate_pair(tmp_path):
    path = jsonl_with(tmp_path / "in.jsonl", '{"text": "fine"}', 50)
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line]
    assert "\U0001F600" in texts[4]
    cfg = tokenizer_config_for("byte")
    ds = preprocess(PreprocessOptions([str(path)], str(tmp_path / "out"), cfg, num_workers=2, shard_bytes=300,
                                      progress=False))
    tok = build_tokenizer(cfg)
    assert [ds[k].tolist() for k in range(len(ds))] == [tok.encode(t) for t in texts]
