# Aligned files (included by __init__.pyx): with ``align=N`` a writer pads the header so
# that the data starts at a multiple of N, and orders the tensors so that as many as
# it can find start at a multiple of N too. The format allows no gap between tensors,
# so alignment comes from the order alone: a tensor whose size is a multiple of N
# keeps the next one aligned, and smaller ones are packed into the gaps the others
# leave, their sizes summing to a multiple of N.

MAX_ALIGN = 1 << 20
# The header of an aligned file (align above 8) ends in at least this many spaces,
# which the format's layout never leaves (it pads to a multiple of 8; only room asked
# for with header_padding does): so that a rewrite of the header (update_metadata) can
# tell the file was aligned, and keep it so.
ALIGNED_HEADER_SPACES = 8
# Element alignment: a tensor starts at a multiple of its element's size (up to 8
# bytes), as in the format's own order. Tensors whose size is a multiple of 8 keep
# every later position a multiple of 8; the others go last, in the format's order.
cdef Py_ssize_t ELEMENT_ALIGN = 8
# The work the search for gap fillers may do in all (sizes, and pairs of them, looked
# at): bounded, whatever the tensors (a real model's few sizes need far less); single
# fillers are always looked for.
cdef Py_ssize_t FILLER_SEARCH_BUDGET = 1 << 20


cdef Py_ssize_t _checked_align(object value) except -1:
    """`value` as an alignment in bytes: 0 (or None) for none, else a power of two."""
    if value is None:
        return 0
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or not 0 <= value <= MAX_ALIGN or value & (value - 1)):
        raise SafetensorError(f"align must be a power of two from 1 to {MAX_ALIGN} bytes "
                              f"(or 0 or None: not aligned), got {_shown(value)}")
    return value


cdef tuple _alignment_score(list entries, Py_ssize_t align):
    """(tensors that start at a multiple of `align`, their bytes) when `entries`
    (plan entries, their byte size at 4) are laid out in this order from offset 0."""
    cdef Py_ssize_t count = 0
    offset = aligned_bytes = 0
    for entry in entries:
        if offset % align == 0:
            count += 1
            aligned_bytes += entry[4]
        offset += entry[4]
    return count, aligned_bytes


cdef list _aligned_order(list entries, Py_ssize_t align):
    """`entries` (plan entries in the format's order) in the order
    that starts the most of them at a multiple of `align`, the largest first where
    not all can be: those whose size is a multiple of `align`; then groups, each a
    tensor as large as any left and the fewest, smallest others that bring the end
    of the group to a multiple of `align`; then those no group could close; then
    the tensors whose size is not a multiple of 8 (see ELEMENT_ALIGN). The format's
    order is kept when it does as well."""
    body = [entry for entry in entries if entry[4] % ELEMENT_ALIGN == 0]
    tail = [entry for entry in entries if entry[4] % ELEMENT_ALIGN]
    if align <= ELEMENT_ALIGN:
        packed = body + tail
    else:
        whole = [entry for entry in body if entry[4] % align == 0]
        rest = [entry for entry in body if entry[4] % align]
        packed = whole + _closed_groups(rest, align) + tail
    if _alignment_score(packed, align) > _alignment_score(entries, align):
        return packed
    return entries


cdef list _closed_groups(list entries, Py_ssize_t align):
    """`entries` (none a multiple of `align` in size) as groups that each start and
    end at a multiple of `align`, each led by the largest tensor left; those that
    no group can close follow, largest first (the first of them starts aligned)."""
    cdef _Fillers fillers = _Fillers([entry[4] for entry in entries], align)
    placed, left = [], []
    for position in sorted(range(len(entries)), key=lambda k: (-entries[k][4], k)):
        if not fillers.take(position):
            continue        # already placed, filling an earlier group's gap
        gap = (align - entries[position][4] % align) % align
        closing = fillers.closing(gap)
        if closing is None:
            left.append(entries[position])
            continue
        placed.append(entries[position])
        for filler in closing:
            fillers.take(filler)
            placed.append(entries[filler])
    return placed + left


cdef class _Fillers:
    """The tensors not yet placed, by size modulo the alignment, smallest first
    (then in the format's order): what may fill the gap a group's head leaves."""
    cdef Py_ssize_t align, budget
    cdef list sizes
    cdef bytearray used
    cdef dict queues      # residue -> positions, smallest first
    cdef dict fronts      # residue -> index of the first position in its queue not taken
    cdef dict counts      # residue -> positions not taken
    cdef list residues    # every residue, ascending
    cdef set unreachable  # gaps no search can fill: the tensors left only dwindle

    def __init__(self, list sizes, Py_ssize_t align):
        self.align, self.sizes, self.budget = align, sizes, FILLER_SEARCH_BUDGET
        self.used = bytearray(len(sizes))
        self.queues, self.fronts, self.counts = {}, {}, {}
        for position in sorted(range(len(sizes)), key=lambda k: (sizes[k], k)):
            residue = sizes[position] % align
            self.queues.setdefault(residue, []).append(position)
            self.counts[residue] = self.counts.get(residue, 0) + 1
            self.fronts[residue] = 0
        self.residues = sorted(self.queues)
        self.unreachable = set()

    cdef bint take(self, Py_ssize_t position):
        """Mark `position` placed; False when it was already."""
        if self.used[position]:
            return False
        self.used[position] = 1
        self.counts[self.sizes[position] % self.align] -= 1
        return True

    cdef list smallest(self, object residue, Py_ssize_t count):
        """The `count` smallest positions not taken of sizes `residue` modulo the
        alignment (there are at least that many)."""
        queue = self.queues[residue]
        cdef Py_ssize_t front = self.fronts[residue]
        while self.used[queue[front]]:
            front += 1
        self.fronts[residue] = front
        found = []
        while len(found) < count:
            if not self.used[queue[front]]:
                found.append(queue[front])
            front += 1
        return found

    cdef object closing(self, object gap):
        """The fewest positions (at most 3) whose sizes sum to `gap` modulo the
        alignment: the smallest of one size, else the pair of the smallest total
        size, else the first triple found (smallest residues first); None when
        none are found."""
        if gap == 0:
            return []
        if self.counts.get(gap, 0):
            return self.smallest(gap, 1)
        if gap in self.unreachable or self.budget <= 0:
            return None
        found, complete = self._search(gap, 2)
        if found is None and complete:
            found, complete = self._search(gap, 3)
        if found is None and complete:
            self.unreachable.add(gap)
        return found

    cdef tuple _search(self, object gap, int depth):
        """(`depth` positions summing to `gap`, or None; whether the search was
        complete, rather than cut short by the budget)."""
        best = best_cost = None
        self.budget -= len(self.residues)
        available = [residue for residue in self.residues if self.counts[residue]]
        for i, first in enumerate(available):
            for second in (available[i:] if depth == 3 else (first,)):
                self.budget -= 1
                if self.budget < 0:
                    return best, False
                if depth == 2:
                    picked = (first, (gap - first) % self.align)
                else:
                    picked = (first, second, (gap - first - second) % self.align)
                if picked[depth - 1] < picked[depth - 2] or not self._enough(picked):
                    continue
                positions = self._positions(picked)
                if depth == 3:
                    return positions, True
                cost = sum([self.sizes[position] for position in positions])
                if best is None or cost < best_cost:
                    best, best_cost = positions, cost
        return best, True

    cdef bint _enough(self, tuple picked):
        for residue in picked:
            if self.counts.get(residue, 0) < picked.count(residue):
                return False
        return True

    cdef list _positions(self, tuple picked):
        positions = []
        for residue in sorted(set(picked)):
            positions += self.smallest(residue, picked.count(residue))
        return positions
