from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_FORMAT_RAW: _ClassVar[ImageFormat]
    IMAGE_FORMAT_PNG: _ClassVar[ImageFormat]
IMAGE_FORMAT_RAW: ImageFormat
IMAGE_FORMAT_PNG: ImageFormat

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class EncodedImages(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("images", "encoded", "request_id")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    images: Tensor
    encoded: EncodedImages
    request_id: str
    def __init__(self, images: _Optional[_Union[Tensor, _Mapping]] = ..., encoded: _Optional[_Union[EncodedImages, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("indices", "request_id", "error")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    indices: Tensor
    request_id: str
    error: Error
    def __init__(self, indices: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[str] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("indices", "request_id", "output_format")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    indices: Tensor
    request_id: str
    output_format: ImageFormat
    def __init__(self, indices: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[str] = ..., output_format: _Optional[_Union[ImageFormat, str]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("images", "encoded", "request_id", "error")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    images: Tensor
    encoded: EncodedImages
    request_id: str
    error: Error
    def __init__(self, images: _Optional[_Union[Tensor, _Mapping]] = ..., encoded: _Optional[_Union[EncodedImages, _Mapping]] = ..., request_id: _Optional[str] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("quantizer", "codebook_size", "levels", "factor", "codes_per_position", "index_dtype", "accepted_sizes", "max_pixels", "max_batch_size", "dtype", "backend", "device", "model_hash", "server_version", "execution_plan", "determinism", "dither", "exact", "source_hash", "encode_only", "token_layout")
    QUANTIZER_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    CODES_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    INDEX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SIZES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PLAN_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    DITHER_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_HASH_FIELD_NUMBER: _ClassVar[int]
    ENCODE_ONLY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    quantizer: str
    codebook_size: int
    levels: _containers.RepeatedScalarFieldContainer[int]
    factor: int
    codes_per_position: int
    index_dtype: str
    accepted_sizes: str
    max_pixels: int
    max_batch_size: int
    dtype: str
    backend: str
    device: str
    model_hash: str
    server_version: str
    execution_plan: str
    determinism: Determinism
    dither: str
    exact: bool
    source_hash: str
    encode_only: bool
    token_layout: TokenLayout
    def __init__(self, quantizer: _Optional[str] = ..., codebook_size: _Optional[int] = ..., levels: _Optional[_Iterable[int]] = ..., factor: _Optional[int] = ..., codes_per_position: _Optional[int] = ..., index_dtype: _Optional[str] = ..., accepted_sizes: _Optional[str] = ..., max_pixels: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., dtype: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., model_hash: _Optional[str] = ..., server_version: _Optional[str] = ..., execution_plan: _Optional[str] = ..., determinism: _Optional[_Union[Determinism, _Mapping]] = ..., dither: _Optional[str] = ..., exact: _Optional[bool] = ..., source_hash: _Optional[str] = ..., encode_only: _Optional[bool] = ..., token_layout: _Optional[_Union[TokenLayout, _Mapping]] = ...) -> None: ...

class TokenLayout(_message.Message):
    __slots__ = ("kind", "schedules", "length", "size", "temporal_factor", "chunk_frames", "pad", "frame_rule")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SCHEDULES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_FACTOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    FRAME_RULE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    schedules: _containers.RepeatedCompositeFieldContainer[ScaleSchedule]
    length: int
    size: _containers.RepeatedScalarFieldContainer[int]
    temporal_factor: int
    chunk_frames: int
    pad: str
    frame_rule: str
    def __init__(self, kind: _Optional[str] = ..., schedules: _Optional[_Iterable[_Union[ScaleSchedule, _Mapping]]] = ..., length: _Optional[int] = ..., size: _Optional[_Iterable[int]] = ..., temporal_factor: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., pad: _Optional[str] = ..., frame_rule: _Optional[str] = ...) -> None: ...

class ScaleSchedule(_message.Message):
    __slots__ = ("heights", "widths")
    HEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    heights: _containers.RepeatedScalarFieldContainer[int]
    widths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, heights: _Optional[_Iterable[int]] = ..., widths: _Optional[_Iterable[int]] = ...) -> None: ...

class Determinism(_message.Message):
    __slots__ = ("batch_invariant", "decode_batch_invariant", "summary")
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    batch_invariant: bool
    decode_batch_invariant: bool
    summary: str
    def __init__(self, batch_invariant: _Optional[bool] = ..., decode_batch_invariant: _Optional[bool] = ..., summary: _Optional[str] = ...) -> None: ...
