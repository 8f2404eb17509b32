"""The token pass over a scanned input: each document's prefix length and every row's prompt checked.

Labels, empty questions and lengths are checked; with --skip-invalid a row that fails is set aside."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kevscore.job.rows import Cursor
from kevscore.job.scan import BATCH_ROWS, InputScan, batches, open_parquet


def measure_tokens(scan: InputScan, tokenizer, template, default_labels: Sequence[str], max_positions: int,
                   skip_invalid: bool = False, keyed: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokenize every document (once) and question, keeping only lengths: each document's prefix length
    (int32; -1 for a doc_id with no document) and, when `keyed`, its prefix key (`prompt.prefix_key`, which keys
    its bank entry; "" for no document), else None. Every row passes `prompt.PromptCheck`, the checks `encode`
    makes, named by input row; with skip_invalid a row that fails is set aside with its reason instead."""
    from kevscore.model.prompt import PromptCheck, label_token_ids, prefix_key, tokenize

    check = PromptCheck(tokenizer, scan.path.name, max_positions)
    doc_tokens = np.full(len(scan.doc_keys), -1, dtype=np.int32)
    keys = np.full(len(scan.doc_keys), "", dtype=object) if keyed else None
    # each document's text read at its row (scan.doc_row), in its file's order, BATCH_ROWS documents at a time
    docs = np.argsort(scan.doc_row, kind="stable")
    docs = docs[scan.doc_row[docs] >= 0]  # not a doc_id without a document (set aside)
    texts = Cursor(scan.documents_path or scan.path, ["document"])
    for some in np.split(docs, range(BATCH_ROWS, len(docs), BATCH_ROWS)):
        prefixes = tokenize(tokenizer, [template.prefix(t) for t in texts.take(scan.doc_row[some])["document"]])
        doc_tokens[some] = [len(ids) for ids in prefixes]
        if keys is not None:
            keys[some] = [prefix_key(ids) for ids in prefixes]
    has_labels = "labels" in scan.columns
    if not has_labels:
        label_token_ids(tokenizer, default_labels, "--labels")  # a label of no tokens stops the run before any row
    columns = ["question"] + (["labels"] if has_labels else [])
    for start, cols in batches(scan.path, open_parquet(scan.path), columns):
        docs = scan.doc_of_row[start:start + len(cols["question"])]
        live = [j for j in range(len(docs)) if docs[j] >= 0]
        branches = tokenize(tokenizer, [template.branch(cols["question"][j]) for j in live])
        for j, ids in zip(live, branches):
            reason, _, tails = check.label_tokens(cols["labels"][j] if has_labels else default_labels)
            if reason and not skip_invalid:
                raise check.label_error(start + j, reason)
            # a row whose labels cannot be scored is not measured
            reason = reason or check.prompt(start + j, int(doc_tokens[docs[j]]), len(ids), tails)
            if reason and skip_invalid:
                scan.set_aside([start + j], reason)
    if (error := check.error()) and not skip_invalid:
        raise error
    return doc_tokens, keys
