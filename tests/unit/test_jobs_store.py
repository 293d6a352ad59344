"""The jobs' disk store (server/jobs.py): restart recovery, expiry, the bytes bound and its eviction.
A clock is passed in, so expiry is tested without waiting."""

import json

import pytest

from hotlora.errors import RequestTooLarge, SettingUnusable
from hotlora.server.jobstore import RESTARTED, JobRecord, JobStore, new_id, video_object, view


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def record(store, owner="key:a", retention_s=60.0, **fields):
    job = JobRecord(id=new_id(), owner=owner, created_at=store.clock(), retention_s=retention_s, **fields)
    store.save(job)
    return job


def test_a_restart_fails_unfinished_jobs_and_keeps_finished_ones(tmp_path):
    clock = Clock()
    first = JobStore(tmp_path, max_bytes=1000, clock=clock)
    queued, running = record(first), record(first, status="running", step=1, total=4)
    done = first.put_result(record(first), {"0.png": b"x" * 10}, "image/png", {"seeds": [0]})

    clock.now += 5
    second = JobStore(tmp_path, max_bytes=1000, clock=clock)  # what a restarted server reads
    for job in (queued, running):
        failed = second.get(job.id)
        assert failed.status == "failed" and failed.error["error"] == RESTARTED
        assert failed.finished_at == clock.now and failed.expires_at == clock.now + 60
    kept = second.get(done.id)
    assert kept.status == "succeeded" and second.read_result(kept) == [b"x" * 10]
    # Written to disk too: a third start reads the failure, not "running".
    on_disk = json.loads((tmp_path / f"{running.id}.json").read_text())
    assert on_disk["status"] == "failed"


def test_finished_jobs_expire_after_their_retention_unfinished_ones_never(tmp_path):
    clock = Clock()
    store = JobStore(tmp_path, max_bytes=1000, clock=clock)
    done = store.put_result(record(store, retention_s=30), {"0.png": b"abc"}, "image/png", {})
    waiting = record(store, retention_s=30)
    clock.now += 29
    assert store.get(done.id) is not None
    clock.now += 2
    assert store.get(done.id) is None and not (tmp_path / done.id).exists()
    assert not (tmp_path / f"{done.id}.json").exists()
    assert store.get(waiting.id).status == "queued"


def test_results_are_bounded_oldest_finished_evicted_first(tmp_path):
    clock = Clock()
    store = JobStore(tmp_path, max_bytes=100, clock=clock)
    jobs = []
    for _ in range(3):
        clock.now += 1
        jobs.append(store.put_result(record(store), {"0.png": b"x" * 40}, "image/png", {}))
    # 120 bytes asked for: the oldest went.
    assert store.get(jobs[0].id) is None and store.get(jobs[1].id) and store.get(jobs[2].id)
    assert store.bytes == 80
    with pytest.raises(RequestTooLarge, match="jobs_max_bytes"):
        store.put_result(record(store), {"0.png": b"x" * 101}, "image/png", {})
    assert store.bytes == 80  # a result that cannot fit evicts nobody


def test_ids_that_new_id_cannot_make_name_nothing(tmp_path):
    store = JobStore(tmp_path, max_bytes=100)
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "secret", "job_" + "a" * 21, "job_" + "a" * 21 + "/"):
        assert store.get(bad) is None


def test_view_and_the_openai_video_mapping_of_one_record(tmp_path):
    store = JobStore(tmp_path, max_bytes=100)
    job = record(store, kind="video", status="running", step=3, total=12, params={"model": "wan", "size": "64x64",
                                                                                  "seconds": "2"})
    shown = view(job)
    assert shown["status"] == "running" and shown["progress"] == {"step": 3, "total": 12, "fraction": 0.25}
    assert shown["links"]["content"] == f"/v1/jobs/{job.id}/content" and "owner" not in shown
    video = video_object(job)
    assert video["object"] == "video" and video["status"] == "in_progress" and video["progress"] == 25
    assert (video["model"], video["size"], video["seconds"]) == ("wan", "64x64", "2")
    done = store.put_result(job, {"0.mp4": b"x"}, "video/mp4", {})
    assert video_object(done)["status"] == "completed" and video_object(done)["completed_at"] is not None


def test_owned_lists_one_owners_jobs_of_a_kind_oldest_first_and_not_the_expired(tmp_path):
    clock = Clock()
    store = JobStore(tmp_path, max_bytes=1000, clock=clock)
    first = record(store, kind="video")
    clock.now += 1
    second = record(store, kind="video", retention_s=5.0)
    record(store, kind="images")
    record(store, owner="key:b", kind="video")
    assert [r.id for r in store.owned("key:a", kind="video")] == [first.id, second.id]
    assert len(store.owned("key:a")) == 3 and len(store.owned("key:b")) == 1
    store.put_result(second, {"0.mp4": b"x"}, "video/mp4", {})
    clock.now += 10  # past the finished one's retention
    assert [r.id for r in store.owned("key:a", kind="video")] == [first.id]


def test_a_folder_that_cannot_be_written_is_refused_naming_the_setting(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SettingUnusable, match="jobs_dir .* cannot be written"):
        JobStore(blocker / "jobs", max_bytes=100)
