"""Where the artifact store is, as one value: its URL and its backend's own options (an S3 server's `endpoint`).

The settings build it in one place (core/settings.py `store_config`) and it travels whole: into the client
(store/objects.py `Store`), in the run spec from a worker to its trainer (contract/spec.py `StoreRef`), and to the
upload process as one JSON argument (store/push.py). Its URL's scheme picks the backend (store/backends/).
Credentials never travel in it, since it is written into run specs and command lines: each backend reads its own
from the environment (the AWS_* variables for S3).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StoreConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(min_length=1, description="file://<folder>, s3://<bucket>/<prefix>, ...: the scheme names "
                                               "the backend")
    options: dict[str, str] = Field(default_factory=dict,
                                    description="The backend's own options by name, such as s3's `endpoint`")

    def __hash__(self) -> int:
        # Pydantic's frozen hash would hash the dict and fail; a process caches one client per config (api/deps.py).
        return hash((self.url, frozenset(self.options.items())))
