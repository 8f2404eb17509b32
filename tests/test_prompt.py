"""kevscore.model.prompt: templates split at the document, the demo chat template, and encoding of input rows."""
from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from kevscore.errors import KevscoreError
from kevscore.job.scan import InputTable
from kevscore.model.prompt import PLAIN_TEMPLATE, Template, chat_template, encode, label_token_ids, load_template, prefix_key

DEMO_HEAD = "<|im_start|>user\n"
DEMO_TAIL = "\n\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tok(demo):
    return demo.tokenizer


@pytest.fixture(scope="module")
def chat(tok) -> Template:
    return chat_template(tok)


def table(documents, questions, doc_ids=None, labels=None, name="in.parquet") -> InputTable:
    return InputTable(list(documents), list(questions), doc_ids, None, labels, [Path("/data") / name])


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- Template.parse

def test_parse_splits_at_the_document() -> None:
    t = Template.parse("A {document} B {question} C", "t.txt")
    assert (t.head, t.tail) == ("A ", " B {question} C")
    assert t.prefix("doc") == "A doc"
    assert t.branch("q?") == " B q? C"
    assert t.prefix("doc") + t.branch("q?") == "A {document} B {question} C".format(document="doc", question="q?")


def test_parse_keeps_other_braces() -> None:
    t = Template.parse("{document} {x} {question} {{", "t.txt")
    assert t.branch("q") == " {x} q {{"


@pytest.mark.parametrize("text", [
    "no placeholders",
    "only {document}",
    "only {question}",
    "{document} {document} {question}",
    "{document} {question} {question}",
])
def test_parse_needs_each_placeholder_once(text: str) -> None:
    with pytest.raises(KevscoreError) as info:
        Template.parse(text, "my.txt")
    msg = str(info.value)
    assert msg.startswith("my.txt: ") and "{document}" in msg and "{question}" in msg and "exactly once" in msg


def test_parse_question_before_document() -> None:
    with pytest.raises(KevscoreError, match=r"my\.txt: \{document\} must come before \{question\}"):
        Template.parse("Q: {question}\nD: {document}", "my.txt")


def test_load_template_file_and_defaults(tmp_path: Path, tok) -> None:
    path = tmp_path / "t.txt"
    path.write_text("D={document};Q={question}")
    assert load_template(path, tok) == Template("D=", ";Q={question}")
    assert load_template(None, tok) == chat_template(tok)

    class NoChat:
        chat_template = None

    assert load_template(None, NoChat()) == Template.parse(PLAIN_TEMPLATE, "x")
    with pytest.raises(KevscoreError, match="cannot read the template"):
        load_template(tmp_path / "missing.txt", tok)


# ---------------------------------------------------------------- the demo's chat template

def test_chat_template_splits_right_after_the_document(chat: Template) -> None:
    assert chat.head == DEMO_HEAD
    assert chat.tail == DEMO_TAIL
    assert chat.prefix("Some text.") == "<|im_start|>user\nSome text."
    assert chat.branch("Is it?") == "\n\nIs it?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("document", ["We walked to the market before breakfast.", "ends in a word",
                                      "trailing space ", "new line\n", "Yes"])
def test_model_sees_prefix_then_branch(tok, chat: Template, document: str) -> None:
    question = "Does the document mention bread?"
    enc = encode(table([document], [question]), tok, chat, ["Yes", "No"], 4096)
    seen = enc.prefixes[enc.row_prefix[0]] + enc.branches[0]
    full = tok.apply_chat_template([{"role": "user", "content": f"{document}\n\n{question}"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert tok.decode(seen) == full
    assert seen == ids(tok, full)  # the split point is a token boundary here
    assert enc.prefixes[0] == ids(tok, DEMO_HEAD + document)
    assert tok.decode(enc.branches[0]) == chat.branch(question)


# ---------------------------------------------------------------- encode

def test_documents_dedupe_by_prefix_ids(tok, chat: Template) -> None:
    docs = ["alpha text.", "beta text.", "alpha text.", "alpha text.", "gamma text.", "beta text."]
    doc_ids = ["a", "b", "a", "a2", "c", "b"]  # "a2" has the same text as "a"
    enc = encode(table(docs, [f"q{i}?" for i in range(6)], doc_ids), tok, chat, ["Yes", "No"], 4096)
    assert enc.row_prefix == [0, 1, 0, 0, 2, 1]
    assert enc.prefixes == [ids(tok, DEMO_HEAD + d) for d in ("alpha text.", "beta text.", "gamma text.")]
    assert len({prefix_key(p) for p in enc.prefixes}) == 3
    assert enc.branches == [ids(tok, chat.branch(f"q{i}?")) for i in range(6)]
    assert len(enc) == 6


def test_prefix_key_is_of_the_ids() -> None:
    assert prefix_key([1, 2, 3]) == prefix_key((1, 2, 3))
    assert prefix_key([1, 2, 3]) != prefix_key([1, 2, 4])
    assert prefix_key([1, 2]) != prefix_key([1, 2, 0])


def test_default_label_ids(tok, chat: Template) -> None:
    enc = encode(table(["d.", "e."], ["q?", "r?"]), tok, chat, ["Yes", "No", " yes"], 4096)
    expected = [tok.encode(x, add_special_tokens=False)[0] for x in ("Yes", "No", " yes")]
    assert len(set(expected)) == 3
    assert enc.labels == [["Yes", "No", " yes"]] * 2
    assert enc.label_ids == [expected] * 2
    assert enc.label_tails is None and enc.one_token_labels(0)  # one token each: the one-position path
    assert tok.convert_ids_to_tokens(expected) == ["Yes", "No", "Ġyes"]


def test_per_row_labels(tok, chat: Template) -> None:
    labels = [["Yes", "No"], ["no", "yes"], ["Yes", "No"], [" No", " Yes", "No"]]
    enc = encode(table(["d."] * 4, ["a?", "b?", "c?", "d?"], labels=labels), tok, chat, ["unused"], 4096)
    assert enc.labels == labels
    one = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc.label_ids == [[one(x)[0] for x in row] for row in labels]
    assert all(len(one(x)) == 1 for row in labels for x in row)


def test_labels_of_several_tokens_are_tokenized_on_their_own(tok, chat: Template) -> None:
    """A label's tokens are those of the label alone (as an answer continues the prompt), its first token
    where a one-token label's would be; rows of one-token labels keep the one-position path."""
    labels = [["Yes", "No"], ["Yes", "maybe"], ["Yes sir", "No way", "No"]]
    enc = encode(table(["d."] * 3, ["a?", "b?", "c?"], labels=labels), tok, chat, ["unused"], 4096)
    one = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    assert len(one("maybe")) > 1 and len(one("Yes sir")) > 1 and one("Yes sir")[0] == one("Yes")[0]
    assert [enc.label_tokens(r) for r in range(3)] == [[one(x) for x in row] for row in labels]
    assert enc.label_ids == [[one(x)[0] for x in row] for row in labels]
    assert [enc.one_token_labels(r) for r in range(3)] == [True, False, False]


def test_label_tokens(tok) -> None:
    assert label_token_ids(tok, ["Yes", "maybe"], "--labels") == [tok.encode(x, add_special_tokens=False)
                                                                 for x in ("Yes", "maybe")]


@pytest.mark.parametrize("label, n", [("Yes No", 2), ("<|im_end|>Yes", 2)])
def test_label_of_several_tokens_or_a_special_one(tok, label: str, n: int) -> None:
    assert label_token_ids(tok, ["No", label], "--labels")[1] == tok.encode(label, add_special_tokens=False)
    assert len(tok.encode(label, add_special_tokens=False)) == n


def test_label_of_no_tokens_is_an_error(tok) -> None:
    with pytest.raises(KevscoreError) as info:
        label_token_ids(tok, ["Yes", ""], "--labels")
    assert str(info.value) == "--labels: label '' tokenizes to no tokens"


def test_label_error_from_column_names_file_and_row(tok, chat: Template) -> None:
    labels = [["Yes", "No"], ["Yes", "No"], ["Yes", "No", ""], ["Yes", "No", ""]]
    with pytest.raises(KevscoreError) as info:
        encode(table(["d."] * 4, list("abcd"), labels=labels, name="qs.parquet"), tok, chat, ["Yes", "No"], 4096)
    assert str(info.value) == "qs.parquet: column 'labels' (row 2): label '' tokenizes to no tokens"


def test_too_long_lists_rows(tok, chat: Template) -> None:
    short, long = "Short.", "A much longer document with many more words in it. " * 3
    docs = [short, long, short, long, short]
    t = table(docs, ["q?"] * 5, name="in.parquet")
    enc = encode(t, tok, chat, ["Yes", "No"], 4096)
    total = [len(enc.prefixes[enc.row_prefix[r]]) + len(enc.branches[r]) for r in range(5)]
    assert total[1] == total[3] > total[0] == total[2] == total[4]
    assert encode(t, tok, chat, ["Yes", "No"], total[1]).row_prefix == enc.row_prefix  # exactly at the limit: fine
    with pytest.raises(KevscoreError) as info:
        encode(t, tok, chat, ["Yes", "No"], total[1] - 1)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("in.parquet: prompt (document + question) longer than the model's")
    assert f"{total[1] - 1} positions at rows 1, 3 (longest {total[1]} tokens)" in msg


def test_too_long_counts_the_labels_tokens_but_their_last(tok, chat: Template) -> None:
    t = table(["Short."] * 2, ["q?"] * 2, labels=[["Yes", "No"], ["Yes", "No way"]], name="in.parquet")
    enc = encode(t, tok, chat, ["unused"], 4096)
    prompt = len(enc.prefixes[0]) + len(enc.branches[0])
    extra = len(tok.encode("No way", add_special_tokens=False)) - 1
    assert encode(t, tok, chat, ["unused"], prompt + extra).label_tails is not None  # exactly at the limit: fine
    with pytest.raises(KevscoreError) as info:
        encode(t, tok, chat, ["unused"], prompt + extra - 1)
    assert str(info.value) == (f"in.parquet: prompt (document + question + label) longer than the model's "
                               f"{prompt + extra - 1} positions at row 1 (longest {prompt + extra} tokens)")


def test_too_long_single_row(tok, chat: Template) -> None:
    t = table(["x."], ["a question that is long enough " * 4])
    with pytest.raises(KevscoreError, match=r"at row 0 \(longest \d+ tokens\)"):
        encode(t, tok, chat, ["Yes", "No"], 10)


def test_empty_branch_is_an_error(tok) -> None:
    bare = Template.parse("{document}{question}", "bare")
    with pytest.raises(KevscoreError, match=r"in\.parquet: column 'question': the prompt branch is empty at row 1"):
        encode(table(["d.", "d."], ["q?", ""]), tok, bare, ["Yes", "No"], 4096)


def test_empty_table(tok, chat: Template) -> None:
    enc = encode(table([], []), tok, chat, ["Yes", "No"], 4096)
    assert len(enc) == 0 and enc.prefixes == [] and enc.label_ids == [] and enc.labels == []


def test_labels_of_the_same_tokens_are_an_error(tok, chat: Template) -> None:
    """A normalizing tokenizer (NFC: Qwen's) reads 'é' and 'e\u0301' alike: their probability would be split."""
    class Normalizing:
        def __call__(self, texts, **kw):
            return tok([unicodedata.normalize("NFC", t) for t in texts], **kw)
    with pytest.raises(KevscoreError) as info:
        label_token_ids(Normalizing(), ["\u00e9", "No", "e\u0301"], "--labels")
    assert str(info.value) == "--labels: labels '\u00e9' and 'e\u0301' tokenize to the same tokens"
    with pytest.raises(KevscoreError) as info:
        encode(table(["d."] * 2, "ab", labels=[["Yes", "No"], ["No", "\u00e9", "e\u0301"]], name="qs.parquet"),
               Normalizing(), chat, ["Yes", "No"], 4096)
    assert str(info.value) == ("qs.parquet: column 'labels' (row 1): labels '\u00e9' and 'e\u0301' tokenize to the "
                               "same tokens")
