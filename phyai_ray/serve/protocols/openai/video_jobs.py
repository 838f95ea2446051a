"""Video jobs that outlive the connection: one store that every replica group's ingress reads.

    store = JobStore("/var/lib/phyai-videos", ttl_s=3600, max_bytes=10 << 30)
    job = store.create(model="wan", prompt="...", size="832x480", seconds="5", owner="group-a", tenant="lab-a")
    store.update(job["id"], status="in_progress", progress=40)     # the group running it, only
    store.finish(job["id"], mp4, png)                                # or store.fail(job["id"], code, message)
    store.get(job["id"])                                             # any group: the job, or None
    store.request_cancel(job["id"]); store.cancel_requested(job["id"])   # DELETE from any group
    page, more = store.list(limit=20, after=None, order="desc", tenant="lab-a")   # that tenant's only

A job lands on one group (the one whose ingress took the POST), but its id may be polled, downloaded
or deleted through any group, so the jobs live in a directory every group reads: on one node the
default temporary one; across nodes a shared filesystem (`video_dir`). Per job `<id>.json` (its
OpenAI `Video` object plus the store's own fields), `<id>.mp4`, `<id>.png`, and `<id>.cancel`, the
flag a DELETE through another group leaves for the one running it. Every write goes to a temporary
file first and is renamed into place, so a reader never sees half a job.

Lifetimes: a finished job (completed or failed) expires `ttl_s` after it finished (`expires_at`); past
`max_bytes` of videos the oldest finished ones go first. Both hold without any read: the routes run
`sweep()` every `sweep_interval(ttl_s)` (at most a minute) from their first request on. A queued or
running job whose group has not touched it (`heartbeat_at`) for `stale_s` is failed by whoever reads it
("its replica group stopped"): a group killed with a job in it leaves nothing that polls forever. Ids
are `video_` + 32 random hex digits (`secrets`), so one caller cannot guess another's.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

FINISHED = ("completed", "failed")
_PRIVATE = ("owner", "tenant", "heartbeat_at", "finished_s", "request")  # store fields the API's Video object does not show


def sweep_interval(ttl_s: float) -> float:
    """How often the routes sweep the store: a quarter of the ttl, between 50 ms and a minute."""
    return min(max(ttl_s / 4, 0.05), 60.0)


def default_directory(app: str = "default") -> Path:
    return Path(tempfile.gettempdir()) / "phyai-ray-videos" / app


class JobStore:
    """Video jobs in a directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, *, ttl_s: float = 3600.0, max_bytes: int = 10 << 30,
                 stale_s: float = 60.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl_s, self.max_bytes, self.stale_s = float(ttl_s), int(max_bytes), float(stale_s)

    # -- files -------------------------------------------------------------------------------------
    def _path(self, ident: str, suffix: str) -> Path:
        if not ident.startswith("video_") or not ident[6:].isalnum() or len(ident) > 64:
            raise KeyError(ident)  # never a path outside the directory
        return self.directory / f"{ident}{suffix}"

    def _write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read(self, ident: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(ident, ".json").read_text())
        except (FileNotFoundError, KeyError, json.JSONDecodeError):
            return None

    def _save(self, job: dict[str, Any]) -> None:
        self._write(self._path(job["id"], ".json"), json.dumps(job).encode())

    def _remove(self, ident: str) -> None:
        for suffix in (".json", ".mp4", ".png"):
            self._path(ident, suffix).unlink(missing_ok=True)

    # -- the running group's side ----------------------------------------------------------------
    def create(self, *, model: str, prompt: str, size: str, seconds: str, owner: str,
               request: dict[str, Any] | None = None, tenant: str | None = None) -> dict[str, Any]:
        now = time.time()
        job = {"id": f"video_{secrets.token_hex(16)}", "object": "video", "status": "queued", "progress": 0,
               "created_at": int(now), "completed_at": None, "expires_at": None, "error": None, "model": model,
               "prompt": prompt, "size": size, "seconds": seconds, "remixed_from_video_id": None,
               "owner": owner, "tenant": tenant, "heartbeat_at": now, "request": request or {}}
        self._save(job)
        return job

    def update(self, ident: str, **fields: Any) -> dict[str, Any] | None:
        """Change a job the caller runs (and touch its heartbeat); None when it was deleted meanwhile."""
        job = self._read(ident)
        if job is None or job["status"] in FINISHED or self.cancel_requested(ident):
            return None
        job.update(fields, heartbeat_at=time.time())
        self._save(job)
        if self.cancel_requested(ident):  # a DELETE came between the check and the save: its files go again
            self._remove(ident)
            return None
        return job

    def finish(self, ident: str, mp4: bytes, png: bytes) -> dict[str, Any] | None:
        if self._read(ident) is None or self.cancel_requested(ident):
            return None
        self._write(self._path(ident, ".mp4"), mp4)
        self._write(self._path(ident, ".png"), png)
        now = time.time()
        job = self.update(ident, status="completed", progress=100, completed_at=int(now), finished_s=now,
                          expires_at=int(now + self.ttl_s))
        self._trim()
        return job

    def fail(self, ident: str, code: str, message: str) -> dict[str, Any] | None:
        now = time.time()
        return self.update(ident, status="failed", completed_at=int(now), finished_s=now,
                           expires_at=int(now + self.ttl_s), error={"code": code, "message": message})

    def cancel_requested(self, ident: str) -> bool:
        return self._path(ident, ".cancel").exists()

    # -- any group's side --------------------------------------------------------------------------
    def get(self, ident: str) -> dict[str, Any] | None:
        """The job (expired ones are removed; a stale queued or running one is failed), or None."""
        try:
            job = self._read(ident)
        except KeyError:
            return None
        if job is None:
            return None
        now = time.time()
        expires = job.get("finished_s", 0) + self.ttl_s if job["status"] in FINISHED else None
        if expires is not None and expires <= now:
            self._remove(ident)
            return None
        if job["status"] not in FINISHED and now - job["heartbeat_at"] > self.stale_s:
            job.update(status="failed", completed_at=int(now), finished_s=now, expires_at=int(now + self.ttl_s),
                       error={"code": "replica_unavailable", "message": f"the replica group running this job "
                              f"stopped answering (no report for {now - job['heartbeat_at']:.0f} s); create it again"})
            self._save(job)
        return job

    def content(self, ident: str, variant: str) -> bytes | None:
        suffix = {"video": ".mp4", "thumbnail": ".png"}[variant]
        try:
            return self._path(ident, suffix).read_bytes()
        except (FileNotFoundError, KeyError):
            return None

    def request_cancel(self, ident: str) -> dict[str, Any] | None:
        """DELETE: the job's files go at once; the group running it sees the flag at its next step and
        stops it there. The flag stays (removed by `_trim` after ttl_s), so a write of the running group
        that raced the DELETE finds it and removes the job again. The job as it was, or None."""
        job = self.get(ident)
        if job is None:
            return None
        if job["status"] not in FINISHED:
            self._write(self._path(ident, ".cancel"), b"")
        self._remove(ident)
        return job

    def list(self, *, limit: int = 20, after: str | None = None, order: str = "desc",
             tenant: str | None = None) -> tuple[list[dict], bool]:
        """A page of `tenant`'s jobs, newest first (order "desc") or oldest first, after the job `after`."""
        jobs = [job for job in (self.get(p.stem) for p in self.directory.glob("video_*.json"))
                if job is not None and job.get("tenant") == tenant]
        jobs.sort(key=lambda j: (j["created_at"], j["id"]), reverse=order == "desc")
        if after is not None:
            ids = [j["id"] for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def sweep(self) -> int:
        """Expire the finished jobs past their ttl, fail the stale ones and hold the disk budget, without
        any caller reading them (the routes' sweeper runs this); how many jobs are left."""
        left = sum(self.get(path.stem) is not None for path in self.directory.glob("video_*.json"))
        self._trim()
        return left

    def _trim(self) -> None:
        """Past max_bytes of results, the oldest finished jobs go (and stale cancel flags)."""
        now = time.time()
        for flag in self.directory.glob("video_*.cancel"):
            if now - flag.stat().st_mtime > self.ttl_s:
                flag.unlink(missing_ok=True)
        sizes = {}
        for path in list(self.directory.glob("video_*.mp4")) + list(self.directory.glob("video_*.png")):
            sizes[path.stem] = sizes.get(path.stem, 0) + path.stat().st_size
        total = sum(sizes.values())
        if total <= self.max_bytes:
            return
        finished = sorted((job.get("finished_s") or 0, ident) for ident in sizes
                          if (job := self._read(ident)) is not None and job["status"] in FINISHED)
        for _, ident in finished:
            if total <= self.max_bytes:
                break
            total -= sizes[ident]
            self._remove(ident)


def public(job: dict[str, Any]) -> dict[str, Any]:
    """The job as OpenAI's `Video` object (the store's own fields left out)."""
    return {key: value for key, value in job.items() if key not in _PRIVATE}
