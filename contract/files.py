"""The names an uploaded file carries: its status, its purpose and its data format. Standard library only, like
contract/codes.py: the API, the control plane and the CLI import them without torch."""

from __future__ import annotations

import enum


class FileStatus(str, enum.Enum):
    """`files.status`: stored and waiting for the control plane's check, then checked one way or the other."""

    def __str__(self) -> str:
        return str(self.value)

    UPLOADED = "uploaded"
    PROCESSED = "processed"  # every line passed; `stats` says what it holds
    ERROR = "error"  # `errors` names the first problems, each with its line


class FilePurpose(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    FINE_TUNE = "fine-tune"


class FileFormat(str, enum.Enum):
    """What the trainer reads (contract/spec.py DataSpec.format), spelled the same way: four formats a supervised
    job trains on, and PREFERENCE, the pairs a preference (DPO) job trains on."""

    def __str__(self) -> str:
        return str(self.value)

    TEXT = "text"
    JSONL = "jsonl"
    CHAT = "chat"
    COMPLETION = "completion"  # {"prompt", "completion"} pairs, OpenAI's format for completion models
    # A prompt and a preferred and a non-preferred answer: OpenAI's DPO shape or trl's prompt/chosen/rejected.
    PREFERENCE = "preference"


# The id `POST /files` gives a file: "file_" and 24 hex digits.
FILE_ID_PATTERN = r"^file_[0-9a-f]{24}$"
