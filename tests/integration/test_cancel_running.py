"""A request cancelled while it runs (a job's DELETE, a client that hung up) or whose deadline passes
while it runs stops at the next denoising step boundary, on the warm compiled engine: nothing
compiles, and the next request gives exactly what it gives on its own."""

import time

import pytest
import torch

from hotlora import Engine
from hotlora.engine.worker import Job, Worker
from hotlora.errors import ClientGone, DeadlineExceeded

from ..helpers import TARGET_RANK, recompiles_are_errors


@pytest.fixture(scope="module")
def served(tiny_models):
    model = tiny_models["flux"]
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=2, compile=True)
    worker = Worker(lambda: engine)
    worker.start()
    yield engine, worker, {"identity": (str(model / "adapters" / "identity-diffusers"), 0.8)}
    worker.stop(drain_timeout_s=30)


def cancel(job):
    job.cancelled.set()


def pass_deadline(job):
    job.deadline = time.monotonic() - 0.001


@pytest.mark.parametrize("stop, error, message", [
    (cancel, ClientGone, "cancelled while running"),
    # Its deadline (``timeout_s``, else the server's ``request_timeout_s``) is when it must have
    # ended, not only started: answered DeadlineExceeded (504).
    (pass_deadline, DeadlineExceeded, "the request's deadline passed while it ran"),
], ids=["cancelled", "deadline"])
def test_a_running_request_stops_at_the_next_step_and_the_engine_stays_warm(served, stop, error, message):
    engine, worker, adapters = served
    pack = dict(adapters=adapters, num_images=4, num_inference_steps=4, seed=7, output_type="latent")
    with recompiles_are_errors():
        alone = engine.generate("a cat", **pack)
        steps, job = [], None

        def progress(done, total):
            steps.append((done, total))
            if done == 3:  # stopped during the first chunk's third step (of 2 chunks x 4 steps)
                stop(job)

        job = Job(engine.prepare("a cat", progress=progress, **pack), deadline=time.monotonic() + 300)
        worker.submit(job)
        with pytest.raises(error, match=f"{message}: stopped after step 3 of 8"):
            job.future.result(timeout=300)
        assert steps == [(1, 8), (2, 8), (3, 8)]  # not one step more, and the second chunk never ran

        after = worker.submit(Job(engine.prepare("a cat", **pack))).result(timeout=300)
        torch.testing.assert_close(after.images, alone.images, atol=0, rtol=0)
    assert engine.recompiles == 0 and worker.rebuilds == 0


def test_a_request_that_is_not_cancelled_runs_to_its_end(served):
    engine, worker, adapters = served
    steps = []
    job = Job(engine.prepare("a cat", adapters=adapters, num_inference_steps=3, output_type="latent",
                             progress=lambda done, total: steps.append(done)))
    worker.submit(job).result(timeout=300)
    assert steps == [1, 2, 3]


def test_a_run_stops_only_once_every_request_in_it_is_cancelled():
    """A mixed batch carries several requests: one cancelled, the others still wanted, it goes on."""
    from hotlora.engine.request import all_cancelled

    flags = [False, False]
    stop = all_cancelled([lambda: flags[0], lambda: flags[1]])
    flags[0] = True
    assert not stop()
    flags[1] = True
    assert stop()
    assert all_cancelled([lambda: True, None]) is None and all_cancelled([]) is None


def test_a_step_cache_holds_nothing_of_a_cancelled_run(tiny_models):
    """diffusers' FirstBlockCache keeps the last step's residuals until the end of ``__call__``; a
    run stopped inside the loop resets them itself, or the next request would start from them."""
    from hotlora.engine.stepcache import StepCache

    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                                    step_cache=StepCache("fbcache", threshold=0.8, warmup_steps=1))
    pack = dict(num_inference_steps=4, seed=3, output_type="latent")
    alone = engine.generate("a cat", **pack)

    def stop_after_two(done, total):
        stopped.append(done)

    stopped = []
    cancelled = engine.prepare("a dog on a hill", progress=stop_after_two, **pack)
    from dataclasses import replace

    with pytest.raises(ClientGone):
        engine.run(replace(cancelled, cancelled=lambda: len(stopped) >= 2))
    assert stopped == [1, 2]
    torch.testing.assert_close(engine.generate("a cat", **pack).images, alone.images, atol=0, rtol=0)
