"""Keys travel as one value (issue 37, "typed seams"): no function of the package takes an
operation's keys and their index words as two parameters; a ``keys.KeyBatch`` carries both,
and each transaction is one."""
from __future__ import annotations

import ast
import pathlib

import numpy as np

from tract_async.keys import KeyBatch, keys_to_words
from tract_async.stores.txn import PutTxn, ReadTxn

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tract_async"


def _pairs() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
                if "keys" in names and "words" in names and node.name != "__init__":
                    out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
    return out


def test_no_function_takes_keys_and_their_words_apart() -> None:
    # the constructors of the batch (KeyBatch, PutTxn, ReadTxn: ``__init__``) take both
    assert _pairs() == [], _pairs()


def test_a_key_batch_holds_the_keys_and_their_words_and_transactions_are_batches() -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    kb = KeyBatch(keys)
    assert kb.keys is keys and len(kb) == 3
    assert np.array_equal(kb.words, keys_to_words(keys))
    given = keys_to_words(keys)
    assert KeyBatch(keys, given).words is given          # words computed once, not again
    assert issubclass(PutTxn, KeyBatch) and issubclass(ReadTxn, KeyBatch)
