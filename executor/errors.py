"""The one exception raised for a bad checkpoint (config, weights, tokenizer, template).

Its message is a single line naming the file and the field or tensor at fault.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed or disagrees with its config.

    file: the file at fault (path as given, or a bare name such as "config.json").
    item: the field or tensor name at fault ("" when the whole file is at fault).
    problem: what is wrong, one line.
    """

    def __init__(self, file: str, item: str, problem: str) -> None:
        self.file = str(file)
        self.item = item
        self.problem = problem
        where = f"{self.file}: {item}" if item else self.file
        super().__init__(" ".join(f"{where}: {problem}".split()))
