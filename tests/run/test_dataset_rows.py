"""A hostile dataset author's rows (audit b2): each bad one is a bad line naming the file, the line and
the field, and the other rows load; never a traceback that stops the whole run."""

from __future__ import annotations

import json

import pytest

from batchrun.run.dataset import MAX_BAD_LINES_LISTED, load_dataset


def _load(tmp_path, lines: list[str]):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in [*lines, '{"prompt": "fine"}']), encoding="ascii")
    rows, problems = load_dataset(str(path))
    return path, rows, problems


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"prompt": "p", "cwd": "/tmp/\\ud800"}', "cwd"),  # was a UnicodeEncodeError: the whole run died
        ('{"prompt": "p", "image": "py\\ud800"}', "image"),
        ('{"prompt": "p", "id": "x\\udfff"}', "id"),
        ('{"prompt": "p", "notes": ["ok", {"deep": "x\\ud800"}]}', "notes"),
        ('{"prompt": "p", "\\ud800": 1}', "\\ud800"),
    ],
)
def test_a_lone_surrogate_in_any_field_is_a_bad_line_naming_the_field(tmp_path, line, field):
    """Such text cannot be UTF-8: the row ran (model calls spent) and then every sample was discarded as
    unencodable_text, or, in a cwd, the dataset's load raised and the run exited 1."""
    path, rows, problems = _load(tmp_path, [line])
    assert [r.prompt for r in rows] == ["fine"]
    assert len(problems) == 1 and problems[0].startswith(f"{path}:1: field ")
    assert "surrogate" in problems[0] and f"field '{field}'" in problems[0]  # escaped, as written


def test_a_row_max_turns_past_the_flags_bound_is_a_bad_line(tmp_path):
    """10**30 was taken: its record's metadata.row_max_turns then overflowed int64 (load_runs failed)."""
    path, rows, problems = _load(tmp_path, ['{"prompt": "p", "max_turns": 1000000000000000000000000000000}'])
    assert [r.prompt for r in rows] == ["fine"]
    assert problems == [
        f"{path}:1: field 'max_turns' must be a positive integer (at most 100000), got 1" + "0" * 30
    ]


@pytest.mark.parametrize(
    "fields",
    [
        {"image": 0},
        {"image": False},
        {"image": []},
        {"docker_image": {}},
        {"image": "", "docker_image": "python:3"},
        {"image": "python:3", "docker_image": 5},
        {"image": "python:3", "docker_image": "alpine"},
        {"image": "alpine\u0000x"},
        {"image": "\u001b]0;pwned\u0007alpine"},
        {"docker_image": "alpine\nx"},
        {"image": "alpine\u009b2J"},
        {"image": "a" * 4096},
    ],
)
def test_an_image_of_the_wrong_type_or_two_images_is_a_bad_line(tmp_path, fields):
    """A falsy image (0, false, [], "") was silently no image: the row ran in --default_image; and of two
    different images one was silently dropped. Control characters reached the terminal as they were
    (the Docker preflight prints each image), and a 100,000-character image padded that list to its width."""
    path, rows, problems = _load(tmp_path, [json.dumps({"prompt": "p", **fields})])
    assert [r.prompt for r in rows] == ["fine"]
    assert len(problems) == 1 and problems[0].startswith(f"{path}:1: field 'image'")


def test_image_and_docker_image_naming_the_same_image_is_that_image(tmp_path):
    _, rows, problems = _load(
        tmp_path,
        [
            '{"prompt": "p", "image": "python:3", "docker_image": "python:3"}',
            '{"prompt": "q", "docker_image": "alpine", "image": null}',
        ],
    )
    assert problems == [] and [r.image for r in rows] == ["python:3", "alpine", None]


def test_an_answer_the_scorer_named_for_every_row_cannot_judge_is_a_bad_line(tmp_path):
    """With --scorer=regex a row's answer that is no valid pattern made every sample a scorer error (and a
    list's bad pattern showed only when no earlier one matched); with --scorer=numeric an answer without
    a number failed every sample, the model's right answer included. Both are the dataset's mistake."""
    lines = [
        '{"prompt": "a", "answer": "(unclosed"}',
        '{"prompt": "b", "answer": ["ok", "[z-a]"]}',
        '{"prompt": "c", "answer": "Paris"}',
        '{"prompt": "d", "answer": "3 1/2"}',
        '{"prompt": "e", "answer": 7}',
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines), "utf-8")
    rows, problems = load_dataset(str(path), scorers=("regex",))
    assert [r.prompt for r in rows] == ["c", "d", "e"]
    assert problems[0].startswith(f"{path}:1: field 'answer' is not a valid regex for --scorer=regex")
    assert problems[1].startswith(f"{path}:2: field 'answer' is not a valid regex") and "[z-a]" in problems[1]
    rows, problems = load_dataset(str(path), scorers=("numeric", "exact"))
    assert [r.prompt for r in rows] == ["d", "e"]
    assert [p.split(": field")[0] for p in problems] == [f"{path}:{n}" for n in (1, 2, 3)]
    assert "holds no number for --scorer=numeric: 'Paris'" in problems[2]
    assert len(load_dataset(str(path))[0]) == 5  # the rows decide their scorer: nothing to refuse


def test_bad_lines_past_the_listed_ones_are_counted_not_held(tmp_path):
    """A message was held for every bad line: 10 MB of "x" lines (5 million) took 700 MB of memory."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n' + "x\n" * (MAX_BAD_LINES_LISTED + 500), "utf-8")
    rows, problems = load_dataset(str(path))
    assert [r.prompt for r in rows] == ["fine"]
    assert len(problems) == MAX_BAD_LINES_LISTED and problems.total == MAX_BAD_LINES_LISTED + 500
    assert problems[0].startswith(f"{path}:2: invalid JSON")
    assert problems[-1].startswith(f"{path}:{MAX_BAD_LINES_LISTED + 1}: invalid JSON")


def test_a_dataset_that_cannot_be_read_exits_2_naming_the_flag(tmp_path, monkeypatch, capsys):
    # Reading /proc/self/mem fails with EIO, as a file on a lost network mount does; a chmod 000 file
    # (run by its non-owner) fails to open. Both were a traceback and exit 1 before any model call.
    import batch_runner

    base = dict(batch_size=1, run_name="r", output_dir=str(tmp_path / "out"), model="mock")
    assert batch_runner.main(dataset_file="/proc/self/mem", **base) == 2
    assert (
        "error: --dataset_file /proc/self/mem: cannot read line 1: Input/output error"
        in capsys.readouterr().err
    )

    from pathlib import Path

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "x"}\n')
    real_open = Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    assert batch_runner.main(dataset_file=str(path), **base) == 2
    assert f"error: --dataset_file {path}: cannot read: Permission denied" in capsys.readouterr().err
    assert not (tmp_path / "out" / "r").exists()


@pytest.mark.parametrize("opening", ["[", "\ufeff[\r", "  [  ", "\n \r\n["])
def test_a_json_array_file_is_refused_not_run_as_its_last_element(tmp_path, opening):
    # json.dump(rows, f) with one element a line: lines 2..N-1 end in ',' (bad lines), the last element's
    # line is a good row: the run went on with 1 of the N rows (exit 0) and N-1 warnings.
    from batchrun.config import UsageError

    path = tmp_path / "d.json"
    elements = [json.dumps({"prompt": f"p{i}"}) for i in range(5)]
    path.write_text(opening + "\n" + ",\n".join(elements) + "\n]\n", encoding="utf-8")
    line = 1 + opening.count("\n")  # blank lines before it are no rows: the array's line is named
    with pytest.raises(UsageError, match=rf"line {line} opens a JSON array: .* not JSON Lines"):
        load_dataset(str(path))
    # An array on one line is one bad line like any other (the file's other rows still load).
    path.write_text('["p"]\n{"prompt": "fine"}\n', encoding="utf-8")
    rows, problems = load_dataset(str(path))
    assert [r.prompt for r in rows] == ["fine"] and problems.total == 1


def test_a_byte_order_mark_on_a_later_line_is_read_as_on_the_first(tmp_path):
    """``cat a.jsonl b.jsonl`` with b.jsonl written on Windows (a BOM, CRLF line ends) puts a BOM at the
    start of a later line: that line was a bad line ("invalid JSON: Expecting value at column 1") and its
    row never ran, where the same mark on line 1 was accepted. Blank and whitespace-only lines are
    skipped silently, and a last line without a newline is read."""
    bom = b"\xef\xbb\xbf"
    a = bom + b'{"prompt": "a1"}\r\n{"prompt": "a2"}\r\n'
    b = bom + b'{"prompt": "b1"}\r\n\r\n  \t \r\n' + bom + b"\r\n" + b'{"prompt": "b2"}'
    path = tmp_path / "d.jsonl"
    path.write_bytes(a + b)
    rows, problems = load_dataset(str(path))
    assert list(problems) == [] and problems.total == 0
    assert [(r.index, r.prompt) for r in rows] == [(0, "a1"), (1, "a2"), (2, "b1"), (6, "b2")]
