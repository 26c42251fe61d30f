"""torch.save files laid out like an already parsed one are located by a few reads, not a zip parse.

At world size 1024 each rank file's zip differs from another's with the same tensor shapes only in
torch.save's archive name (the file's stem, the first part of every record name) and each record's
CRC; parsing every file's central directory with ``zipfile`` and reading each record's local header
(~115 records) cost more than the rest of planning. So an archive parsed the full way (its records
from ``zipfile``, each local header read and checked: ``torch_files``) becomes a layout, and another
file of the same size is laid out the same way when, byte for byte, its central directory through
the end of the file is the layout's with its own stem as the archive name and any CRCs, and each
local header (and the few bytes of ``version``, ``byteorder`` and the like that torch.load reads) is
the layout's with its stem: then every record has the layout's name, size, flags, header and data
offset, and torch's zip reader reads it as it read the parsed one. That takes one read of the
directory and one per run of neighbouring local headers. Any other file -- re-packed, renamed, one byte off -- is not matched and is parsed the full
way (read or refused). CRCs are checked on neither path.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from merge_pipeline.formats.torch_files import METADATA_RECORDS, TorchArchive, read_at
from merge_pipeline.plan import SourceFile

_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # a central directory entry's fixed part, as zipfile reads it
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_CRC_AT = 16  # within a central directory entry
_NAME_AT = 30  # within a local header; in a central directory entry it is _CENTRAL.size
_NO_CRC = bytes(4)
# Local headers are read together, by one pread of at most _WINDOW bytes, when the data between
# them is at most _SKIP bytes (read and dropped): planning then reads little of the tensor data.
_WINDOW = 64 << 10
_SKIP = 4096


@dataclass(frozen=True)
class ArchiveLayout:
    size: int  # of the whole file
    name_length: int  # of the archive name
    directory_start: int
    directory: tuple[bytes, ...]  # the directory through the end, CRCs zeroed, cut where the archive name stands
    crcs: tuple[int, ...]  # where the directory's CRC fields are
    # each read: start, length, where its local headers lie in it, and the bytes around their archive names
    windows: tuple[tuple[int, int, tuple[tuple[int, int], ...], tuple[bytes, ...]], ...]
    records: dict[str, tuple[int, int]]  # record name after the archive name -> (data offset, size)

    @classmethod
    def of(cls, archive: TorchArchive) -> ArchiveLayout | None:
        """The layout of an archive whose records were found the full way; ``None`` if no record starts at
        byte 0 (then the file's first bytes would go uncompared) or a name is not ASCII."""
        stream, prefix = archive.stream, archive.prefix
        if not prefix.isascii() or not any(info.header_offset == 0 for info in archive.records.values()):
            return None
        size = stream.seek(0, io.SEEK_END)
        directory = read_at(stream, size - archive.directory_start, archive.directory_start)
        crcs, names, at = [], [], 0
        for name in archive.records:
            if directory[at : at + 4] != _CENTRAL_SIGNATURE or at + _CENTRAL.size > len(directory):
                return None
            fields = _CENTRAL.unpack_from(directory, at)
            name_at = at + _CENTRAL.size
            if directory[name_at : name_at + fields[12]] != name or not name.isascii():
                return None
            crcs.append(at + _CRC_AT)
            names.append(name_at)
            at = name_at + fields[12] + fields[13] + fields[14]
        masked = bytearray(directory)
        for crc in crcs:
            masked[crc : crc + 4] = _NO_CRC
        records, headers = {}, []
        for name, record in archive.records.items():
            data = archive.offsets[name]
            short = name[len(prefix) + 1 :]
            # The records torch.load reads a few bytes of (version, byteorder, ...) are compared with
            # their headers: what torch accepted in this file, it accepts in a file that matches.
            end = data + (record.file_size if short in METADATA_RECORDS else 0)
            header = read_at(stream, end - record.header_offset, record.header_offset)
            headers.append((record.header_offset, (header[:_NAME_AT], header[_NAME_AT + len(prefix) :])))
            records[short.decode()] = (data, record.file_size)
        return cls(
            size,
            len(prefix),
            archive.directory_start,
            _cut(bytes(masked), names, len(prefix)),
            tuple(crcs),
            _windows(headers, len(prefix)),
            records,
        )

    def locate(self, file: SourceFile, name: str) -> dict[str, tuple[int, int]] | None:
        """Each record's (data offset, size) in ``file``, whose archive
        name must be ``name``, if it is laid out as this layout; else ``None``."""
        encoded = name.encode()
        if file.size != self.size or len(encoded) != self.name_length:
            return None
        found = bytearray(file.pread(self.size - self.directory_start, self.directory_start))
        for crc in self.crcs:
            found[crc : crc + 4] = _NO_CRC
        if found != encoded.join(self.directory):
            return None
        for start, length, headers, around in self.windows:
            window = file.pread(length, start)
            # the window's headers one after the other, against the layout's with this file's archive name
            if b"".join([window[at:end] for at, end in headers]) != encoded.join(around):
                return None
        return self.records


def _cut(directory: bytes, names: list[int], length: int) -> tuple[bytes, ...]:
    """``directory`` without the ``length`` bytes at each of ``names``: the pieces between them."""
    pieces, start = [], 0
    for at in names:
        pieces.append(directory[start:at])
        start = at + length
    pieces.append(directory[start:])
    return tuple(pieces)


def _windows(headers: list[tuple[int, tuple[bytes, bytes]]], name_length: int) -> tuple:
    """Local headers grouped into reads (``_WINDOW``, ``_SKIP``): each read's start and length, each
    header's place in it, and the headers' bytes around the archive names, for ``name.join``."""
    windows: list[tuple[int, int, list]] = []
    for offset, parts in sorted(headers):
        end = offset + len(parts[0]) + name_length + len(parts[1])
        if windows and end - windows[-1][0] <= _WINDOW and offset - (windows[-1][0] + windows[-1][1]) <= _SKIP:
            start, _, members = windows[-1]
        else:
            start, members = offset, []
            windows.append((start, 0, members))
        members.append((offset - start, parts))
        windows[-1] = (start, max(windows[-1][1], end - start), members)
    out = []
    for start, length, members in windows:
        places = tuple((at, at + len(before) + name_length + len(after)) for at, (before, after) in members)
        around = [members[0][1][0]]
        for (_, (_, after)), (_, (before, _)) in zip(members, members[1:]):
            around.append(after + before)
        around.append(members[-1][1][1])
        out.append((start, length, places, tuple(around)))
    return tuple(out)
