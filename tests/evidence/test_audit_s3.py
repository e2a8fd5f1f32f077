"""``audit verify`` of a run copied to S3 (moto's server on 127.0.0.1): the same checks over
``s3://``, through the store's fsspec backend."""

from __future__ import annotations

from cleanroom.checks.audit import verify_run
from cleanroom.store.remote import FsspecStore
from tests.evidence.test_audit import Runs, runs  # noqa: F401 (the fixture)
from tests.store.test_store_s3 import endpoint, s3  # noqa: F401 (the fixtures)


def test_a_run_copied_to_s3_verifies_and_tampering_is_named(
    runs: Runs,  # noqa: F811
    s3: FsspecStore,  # noqa: F811
) -> None:
    src = runs.h.store.root
    for path in sorted(src.rglob("*")):
        if path.is_file():
            s3.fs.pipe_file(f"{s3.root}/{path.relative_to(src)}", path.read_bytes())
    report = verify_run(s3, "A", runs.trusted)
    assert report.ok, report.problems
    assert report.records == 3
    record = f"{s3.root}/runs/A/episodes/b/result.json"
    s3.fs.pipe_file(record, s3.fs.cat_file(record).replace(b'"seed": 4', b'"seed": 5'))
    assert verify_run(s3, "A", runs.trusted).problems[0] == (
        "episode b: result.json does not match its signed digest"
    )
