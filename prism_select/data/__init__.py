"""Reading pool and target files: formats, record forms, validation."""

from .readers import (FORMATS, detect_format, iter_records, load_arrow_dir, load_pool,
                      load_targets, parse_pool_record, parse_target_record, record_id)
from .records import InvalidRecord, Loaded, PoolExample, Prompt, TargetPair

__all__ = [
    "FORMATS", "detect_format", "iter_records", "load_arrow_dir", "load_pool", "load_targets",
    "parse_pool_record", "parse_target_record", "record_id",
    "InvalidRecord", "Loaded", "PoolExample", "Prompt", "TargetPair",
]
