"""Values to bytes and back, and the copies in between.

* :mod:`tq_redis.codec.tensors` -- the tensor codec: one field of a batch <-> one stored value per sample;
* :mod:`tq_redis.codec.wireformat` -- the stored byte format of one value (a self-describing header);
* :mod:`tq_redis.codec.objects` -- the safe object encoding (msgpack, no pickle by default), with
  :mod:`tq_redis.codec.item_classes` (which dataclasses and NamedTuples it may carry);
* :mod:`tq_redis.codec.batches` -- the batch containers a store sees;
* :mod:`tq_redis.codec.buffers`, :mod:`tq_redis.codec.fastcopy`, :mod:`tq_redis.codec.batchscan` --
  warm output buffers and the optional native copy and scan modules (``_copy.c``, ``_scan.c``).
"""
