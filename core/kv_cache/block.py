"""KVCacheBlock, the bookkeeping record of one physical KV block, and the free queue that links them."""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """Metadata of one physical block: who uses it and which token content (if any) it is known to hold.

    `ref_cnt` counts the requests holding the block. `block_hash` is set once the block is full and
    registered for prefix caching; `group_id` says which KV-cache group registered it, because groups with
    different layer types hold different data under the same token hash. `prev_free`/`next_free` link the
    block into `FreeKVCacheBlockQueue` and are None exactly when it is not in that queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        # The null block is a placeholder (e.g. for blocks a sliding window has dropped); never ref-counted.
        self.is_null = False

    def reset_hash(self) -> None:
        """Forget the block's content: it will be overwritten by its next owner."""
        self.block_hash = None
        self.group_id = 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in the order they will be handed out (head first).

    A Python deque cannot remove from the middle in O(1), and a prefix-cache hit on a free (ref 0) cached
    block must do exactly that, so the links live on the blocks themselves. Two sentinel nodes remove every
    empty-list special case from the pointer surgery.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the next to be handed out). Raises ValueError when empty."""
        first = self._head.next_free
        assert first is not None
        if first is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, head first. Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: it is handed out after every block already in the queue."""
        self._link_before(self._tail, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head: it is the next block handed out."""
        first = self._head.next_free
        assert first is not None
        self._link_before(first, block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append each of `blocks` at the tail, in order."""
        for block in blocks:
            self.append(block)

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` out of the queue wherever it is, in O(1)."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head first (O(n); for tests and debugging)."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free
        return out

    def _link_before(self, succ: KVCacheBlock, block: KVCacheBlock) -> None:
        # A block linked twice would corrupt the list silently; catch it here, where it is cheap.
        assert block.prev_free is None and block.next_free is None, f"{block} is already in the free queue"
        pred = succ.prev_free
        assert pred is not None
        block.prev_free, block.next_free = pred, succ
        pred.next_free = block
        succ.prev_free = block
        self.num_free_blocks += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        pred, succ = block.prev_free, block.next_free
        assert pred is not None and succ is not None
        pred.next_free = succ
        succ.prev_free = pred
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
