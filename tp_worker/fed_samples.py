"""The last id each table row sampled, fed where a step says FED_LAST_SAMPLE (tp_worker).

With overlap scheduling the controller sends step N + 1 before step N's result is back, so
a row decoding in both does not know its input token yet: the worker does, it sampled it.
"""

from __future__ import annotations

import msgspec
import numpy as np

from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.step import FED_LAST_SAMPLE, ForwardBatch, StepResult

_FED_BYTES = np.array([FED_LAST_SAMPLE], "<i4").tobytes()


class LastSamples:
    def __init__(self, num_rows: int) -> None:
        self.ids = np.zeros(num_rows, np.int32)  # [table rows] last id sampled for each

    def feed(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with each FED_LAST_SAMPLE replaced by its row's last sampled id."""
        # NOTE: a search of the bytes first (most steps have none: no overlap scheduling). Ids
        # are non-negative int32s, whose last byte is below 0x80, so the bytes of -1 can only
        # appear as a whole element.
        if _FED_BYTES not in batch.input_ids.data:
            return batch
        ids = unpack(batch.input_ids)
        unknown = ids == FED_LAST_SAMPLE
        if not unknown.any():
            return batch
        rows = np.repeat(unpack(batch.req_rows), unpack(batch.extend_lens))
        fed = ids.astype(np.int32)  # NOTE: a copy (the message's bytes are read-only)
        fed[unknown] = self.ids[rows[unknown]]
        return msgspec.structs.replace(batch, input_ids=pack(fed))

    def record(self, batch: ForwardBatch, result: StepResult) -> None:
        """NOTE: rows mid-prompt record an id nobody reads: the controller sends
        FED_LAST_SAMPLE only for a row whose step before sampled for real. A row that
        verified drafts records the sample after its last kept one."""
        ids = unpack(result.next_ids)
        if result.num_accepted is None:
            self.ids[unpack(batch.req_rows)] = ids[-1]
        else:
            accepted = unpack(result.num_accepted)
            self.ids[unpack(batch.req_rows)] = ids[accepted, np.arange(ids.shape[1])]
