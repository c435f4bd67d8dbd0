"""examples/sft.py with the Hugging Face Hub replaced by a recorder (no network in tests): ``HfApi.create_repo``
and ``upload_folder`` append what they were asked, and the folder's files as the upload would take them, to the
JSON lines file ``$MTK_HUB_LOG``. ``$MTK_HUB_FAIL``: ``create`` (the repository cannot be created: no network)
or ``checkpoints`` (each checkpoint folder's background upload fails).

    accelerate launch --config_file accelerate_configs/tp2.yaml tests/e2e/hub_script.py [sft.py's flags]
"""

import fnmatch
import hashlib
import json
import os
import runpy
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import httpx2
from huggingface_hub import HfApi

ROOT = Path(__file__).resolve().parents[2]
FAILING = os.environ.get("MTK_HUB_FAIL", "")


def _record(entry: dict) -> None:
    with open(os.environ["MTK_HUB_LOG"], "a") as log:
        log.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), **entry}) + "\n")


def create_repo(self, repo_id: str, **kwargs):
    if FAILING == "create":
        raise httpx2.ConnectError("[Errno -2] Name or service not known")
    _record({"call": "create_repo", "repo_id": repo_id})
    return SimpleNamespace(repo_id=repo_id)


def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, ignore_patterns=None, run_as_future=False, **kw):
    folder = Path(folder_path)
    patterns = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or [])
    names = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())
    files = [name for name in names if not any(fnmatch.fnmatch(name, p) for p in patterns)]  # (huggingface_hub's)
    weights = folder / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() and not path_in_repo else None
    _record({"call": "upload_folder", "folder": str(folder), "path_in_repo": path_in_repo, "files": files,
             "ignore_patterns": patterns, "message": kw.get("commit_message"), "weights": digest})  # fmt: skip
    done: Future = Future()
    if FAILING == "checkpoints" and path_in_repo:
        done.set_exception(httpx2.ConnectError("upload of a checkpoint: connection reset"))
    else:
        done.set_result(SimpleNamespace(commit_url="https://huggingface.co/fake"))
    return done if run_as_future else done.result()


HfApi.create_repo = create_repo
HfApi.upload_folder = upload_folder
sys.argv[0] = str(ROOT / "examples" / "sft.py")  # (mtk's entry point knows a launched sft.py by its name)
sys.path.insert(0, str(ROOT / "examples"))
runpy.run_path(sys.argv[0], run_name="__main__")
