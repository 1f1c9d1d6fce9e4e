"""Files that expire: `expires_after` on upload, `expires_at` on the file object, batch
output files expiring after `output_expires_after` or LLMQ_BATCH_OUTPUT_EXPIRES_SECONDS, a
404 once expired (before beat's sweep) and the sweep deleting the chunks. Real Postgres,
the Flask app over HTTP, the official `openai` client."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta

import openai
import pytest
import requests
from sqlalchemy import func, select, update

from tasks.batches import finalize_if_done
from tasks.db import utcnow
from tasks.files import delete_expired_files
from tasks.models import Batch, File, FileChunk
from tests.batch_helpers import store_ended_batch

pytestmark = pytest.mark.integration

LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                   "body": {"model": "tiny", "prompt": "hi", "max_tokens": 2}}) + "\n"


def _num_chunks(session_factory, file_id: str) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(FileChunk).where(
            FileChunk.file_id == file_id)) or 0


def test_an_expired_file_is_gone_before_and_after_the_sweep(client, base_url, session_factory):
    kept = client.files.create(file=("kept.jsonl", io.BytesIO(LINE.encode())), purpose="batch")
    assert kept.expires_at is None
    upload = client.files.create(file=("soon.jsonl", io.BytesIO(LINE.encode())),
                                 purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert upload.expires_at - upload.created_at == 3600
    assert client.files.retrieve(upload.id).expires_at == upload.expires_at
    assert _num_chunks(session_factory, upload.id) == 1
    # an hour passes
    with session_factory.begin() as session:
        session.execute(update(File).where(File.id == upload.id).values(
            expires_at=utcnow() - timedelta(seconds=1)))
    for call in (lambda: client.files.retrieve(upload.id),
                 lambda: client.files.content(upload.id),
                 lambda: client.files.delete(upload.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    listed = [f.id for f in client.files.list(limit=10_000)]
    assert upload.id not in listed and kept.id in listed
    with pytest.raises(openai.BadRequestError):  # no longer a batch input
        client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                              completion_window="24h")
    assert _num_chunks(session_factory, upload.id) == 1  # not swept yet: still a 404
    assert upload.id in delete_expired_files(session_factory)
    assert _num_chunks(session_factory, upload.id) == 0
    with session_factory() as session:
        assert session.get(File, upload.id) is None and session.get(File, kept.id) is not None
    assert requests.get(f"{base_url}/v1/files/{upload.id}", timeout=30).status_code == 404


@pytest.mark.parametrize("fields, param", [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
     "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
     "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"},
     "expires_after.seconds"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
     "expires_after.anchor"),
    ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600",
      "expires_after[extra]": "1"}, "expires_after.extra"),
    ({"expires_after": "{not json"}, "expires_after"),
    ({"expires_after": "[3600]"}, "expires_after"),
    ({"expires_after": "{}"}, "expires_after.anchor"),
])
def test_a_bad_expires_after_is_a_400_naming_the_field(base_url, fields, param):
    def num_files() -> int:
        return len(requests.get(base_url + "/v1/files", timeout=30).json()["data"])

    before = num_files()
    answer = requests.post(base_url + "/v1/files", data={"purpose": "batch", **fields},
                           files={"file": ("x.jsonl", LINE.encode())}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert num_files() == before  # nothing stored


def test_expires_after_as_one_json_field(base_url):
    def upload(fields: dict[str, str]) -> dict:
        answer = requests.post(base_url + "/v1/files", data={"purpose": "batch", **fields},
                               files={"file": ("x.jsonl", LINE.encode())}, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()

    body = upload({"expires_after": json.dumps({"anchor": "created_at", "seconds": 7200})})
    assert body["expires_at"] - body["created_at"] == 7200
    assert upload({"expires_after": "null"})["expires_at"] is None  # the schema's null
    # a form field without a name is ignored, not a 500
    parts = ((b"form-data", b"x"), (b'form-data; name="purpose"', b"batch"),
             (b'form-data; name="file"; filename="x.jsonl"', LINE.encode()))
    body = b"".join(b"--b0undary\r\nContent-Disposition: %s\r\n\r\n%s\r\n" % part
                    for part in parts) + b"--b0undary--\r\n"
    answer = requests.post(base_url + "/v1/files", data=body, timeout=30, headers={
        "Content-Type": "multipart/form-data; boundary=b0undary"})
    assert answer.status_code == 200 and answer.json()["expires_at"] is None, answer.text


def test_batch_output_files_expire(client, service_settings, session_factory):
    input_id = client.files.create(file=("in.jsonl", io.BytesIO(LINE.encode())),
                                   purpose="batch").id
    default = client.batches.create(input_file_id=input_id, endpoint="/v1/completions",
                                    completion_window="24h")
    asked = client.batches.create(input_file_id=input_id, endpoint="/v1/completions",
                                  completion_window="24h", extra_body={
                                      "output_expires_after": {"anchor": "created_at",
                                                               "seconds": 3600}})
    with session_factory() as session:
        assert session.get(Batch, default.id).output_expires_seconds == \
            service_settings.batch_output_expires_seconds == 30 * 24 * 3600
        assert session.get(Batch, asked.id).output_expires_seconds == 3600
    for batch in (default, asked):
        client.batches.cancel(batch.id)
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=input_id, endpoint="/v1/completions",
                              completion_window="24h", extra_body={
                                  "output_expires_after": {"anchor": "created_at",
                                                           "seconds": 5}})
    assert bad.value.body["param"].startswith("output_expires_after")
    # a finished batch whose files live a second
    batch_id = store_ended_batch(session_factory, ("succeeded", "failed"),
                                 input_file_id=input_id, output_expires_seconds=1)
    assert finalize_if_done(session_factory, batch_id)
    done = client.batches.retrieve(batch_id)
    files = [client.files.retrieve(file_id) for file_id in (done.output_file_id,
                                                            done.error_file_id)]
    assert all(f.expires_at is not None and f.expires_at - f.created_at <= 1 for f in files)
    time.sleep(1.5)
    for f in files:
        with pytest.raises(openai.NotFoundError):
            client.files.content(f.id)
    assert {f.id for f in files} <= set(delete_expired_files(session_factory))
    assert all(_num_chunks(session_factory, f.id) == 0 for f in files)
