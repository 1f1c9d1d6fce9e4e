"""The Files API's bodies (`/v1/files`, OpenAI's shapes): a file object, a listing, a
deletion, the upload form, a file's expiry policy and the listing's query."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

FILE_PURPOSES = ("batch",)  # what a client may upload; the server writes `batch_output`
MAX_FILE_PAGE_SIZE = 10_000  # OpenAI's bound on `limit`
DEFAULT_FILE_PAGE_SIZE = 10_000
EXPIRES_AFTER_SECONDS = (3600, 30 * 24 * 3600)  # OpenAI's bounds: an hour to 30 days


class ExpiresAfter(BaseModel):
    """When a file expires: `seconds` after its `anchor` (its creation)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = Field(description="the time the expiry counts from")
    seconds: Annotated[int, Field(ge=EXPIRES_AFTER_SECONDS[0], le=EXPIRES_AFTER_SECONDS[1])] = (
        Field(description="seconds after the anchor, 3600 (an hour) to 2592000 (30 days)"))


class FileUpload(BaseModel):
    """`POST /v1/files` (multipart/form-data): the file's bytes and its purpose."""

    file: bytes = Field(description="the JSONL file of requests", json_schema_extra={
        "format": "binary", "contentMediaType": "application/octet-stream"})
    purpose: Literal["batch"] = Field(description="only `batch` files are accepted")
    expires_after: ExpiresAfter | None = Field(None, description="the file is deleted then "
                                               "(as `expires_after[anchor]` and "
                                               "`expires_after[seconds]` fields, or one "
                                               "JSON field); by default it is kept")


class FileObject(BaseModel):
    """A stored file."""

    id: str  # file-<hex>
    object: Literal["file"]
    bytes: int
    created_at: int  # unix seconds
    expires_at: int | None = None  # unix seconds; None: kept until deleted
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]  # OpenAI's (deprecated) field: always processed here
    status_details: str | None = None


class FileList(BaseModel):
    """The caller's files, newest first."""

    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None  # pass as `after` for the next page
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class FileListQuery(BaseModel):
    """`GET /v1/files` query; unknown parameters are a 400."""

    model_config = ConfigDict(extra="forbid")

    after: str | None = Field(None, description="the `last_id` of the previous page")
    limit: Annotated[int, Field(ge=1, le=MAX_FILE_PAGE_SIZE)] = Field(
        DEFAULT_FILE_PAGE_SIZE, description="files per page")
    order: Literal["asc", "desc"] = Field("desc", description="by creation time")
    purpose: str | None = Field(None, description="only files of this purpose")
