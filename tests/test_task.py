"""task.py: the leaderboard's type names."""
import typing

import task


def test_names_and_spec_keys():
    assert isinstance(task.input_t, typing.TypeVar) and isinstance(task.output_t, typing.TypeVar)
    assert set(typing.get_type_hints(task.TestSpec)) == {"batchsize", "qseqlen", "kvseqlen", "seed"}
    spec: task.TestSpec = {"batchsize": 4, "qseqlen": 1, "kvseqlen": 1024, "seed": 4220}
    assert spec["kvseqlen"] == 1024
