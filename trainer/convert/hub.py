"""Uploading a verified conversion to the Hugging Face Hub, checked before any work.

:func:`check_hub` fails fast (huggingface_hub importable, a repository id, not offline, a token, the
endpoint reachable) so that a run never converts for an hour and then fails at the upload; :func:`push`
uploads the folder. Used by the post-job hook and by ``python -m trainer.convert.to_hf --push-to-hub``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse


class HubUnavailable(RuntimeError):
    """push_to_hub was asked for but cannot work here; raised before any conversion work."""


def check_hub(repo: str | None, timeout_s: float = 5.0) -> str:
    """Fail fast unless an upload to the Hub can work; returns the token."""
    try:
        import huggingface_hub
    except ImportError as e:
        raise HubUnavailable("push_to_hub needs the huggingface_hub package (pip install "
                             "huggingface_hub)") from e
    if not repo:
        raise HubUnavailable("push_to_hub needs a repository id ('user/model-name')")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise HubUnavailable("push_to_hub: HF_HUB_OFFLINE is set; unset it or drop push_to_hub")
    token = huggingface_hub.get_token()
    if not token:
        raise HubUnavailable("push_to_hub: no Hugging Face token (set HF_TOKEN or run `hf auth login`); "
                             "nothing was converted")
    endpoint = os.environ.get("HF_ENDPOINT") or huggingface_hub.constants.ENDPOINT
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
    except OSError as e:
        raise HubUnavailable(f"push_to_hub: cannot reach {endpoint} ({e}); no network here? Nothing "
                             "was converted; drop push_to_hub and upload the hf/ folder from a machine "
                             "online") from e
    return token


def push(folder: Path, repo: str, token: str, private: bool) -> str:
    """Upload a verified folder; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, private=private, exist_ok=True)
    return str(api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="Slipway conversion"))
