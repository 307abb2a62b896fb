"""tiktoken's ``o200k_base`` ranks file, rebuilt from the npm package ``js-tiktoken`` for a machine
that cannot download it (lionagi counts every request's tokens with it).

Owns the rebuild only: js-tiktoken carries the same ranks, grouped as ``<first> <offset> <b64>...``
lines; tiktoken reads ``<b64> <rank>`` lines from a cache folder (``TIKTOKEN_CACHE_DIR``),
under the SHA-1 of the URL it would download. The file is written only when its SHA-256 is
the one tiktoken pins, so tiktoken loads it exactly as if it had downloaded it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import tarfile

__all__ = ["O200K_SHA256", "O200K_URL", "ensure_o200k_base"]

O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken_ext.openai_public
RANKS_MEMBER = "package/dist/ranks/o200k_base.js"


def _package(folder: str) -> str | None:
    """The js-tiktoken package archive in ``folder``, fetched there with ``npm pack`` if none is."""
    found = sorted(glob.glob(os.path.join(folder, "js-tiktoken-*.tgz")))
    if found:
        return found[-1]
    os.makedirs(folder, exist_ok=True)
    try:
        subprocess.run(["npm", "pack", "js-tiktoken"], cwd=folder, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    found = sorted(glob.glob(os.path.join(folder, "js-tiktoken-*.tgz")))
    return found[-1] if found else None


def rebuild(archive: str) -> bytes:
    """The ``.tiktoken`` file's bytes from js-tiktoken's ``o200k_base`` ranks."""
    with tarfile.open(archive) as package:
        member = package.extractfile(RANKS_MEMBER)
        if member is None:
            raise ValueError(f"{archive} has no {RANKS_MEMBER}")
        source = member.read().decode()
    ranks = json.loads(source[source.index("{"):source.rindex("}") + 1])["bpe_ranks"]
    lines = []
    for line in ranks.split("\n"):
        if not line:
            continue
        _, offset, *tokens = line.split(" ")
        lines.extend(f"{token} {int(offset) + index}\n" for index, token in enumerate(tokens))
    return "".join(lines).encode()


def ensure_o200k_base(cache_dir: str, package_folder: str) -> str:
    """Make ``cache_dir`` hold tiktoken's ``o200k_base`` file (rebuilt from js-tiktoken in
    ``package_folder``); returns ``cache_dir``. Raises ValueError when it cannot be made exactly."""
    path = os.path.join(cache_dir, hashlib.sha1(O200K_URL.encode()).hexdigest())
    if os.path.exists(path):
        with open(path, "rb") as handle:
            if hashlib.sha256(handle.read()).hexdigest() == O200K_SHA256:
                return cache_dir
    archive = _package(package_folder)
    if archive is None:
        raise ValueError(f"no js-tiktoken package in {package_folder}, and `npm pack js-tiktoken` failed there")
    data = rebuild(archive)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise ValueError(f"o200k_base rebuilt from {archive} has SHA-256 {digest}, not tiktoken's {O200K_SHA256}")
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + ".partial", "wb") as handle:
        handle.write(data)
    os.replace(path + ".partial", path)
    return cache_dir
