meta:
  id: leanimg
  title: Lean VM memory image
  application: leanimg
  file-extension: lean
  license: Apache-2.0
  ks-version: '0.11'
  encoding: UTF-8
  endian: le
doc: |
  A lean image holds the memory of a virtual machine (named RAM regions and
  their pages) together with the device state of the save file it was made
  from. Pages are stored zstd-compressed, or referenced: all-zero, free,
  taken from a disk image, taken from a parent image, or as a small delta
  against the parent's page.

  The file is a header, a sequence of 8-byte aligned records ending with the
  INDEX record, and a 48-byte footer that is always the last 48 bytes of the
  file. Writers write strictly sequentially; a file without a valid footer is
  an incomplete image.

  Checksums (xxh3-64) and digests (xxh3-128) cannot be checked by this
  description; `leanimg validate` checks them.
doc-ref: spec/format.md
seq:
  - id: header
    type: header
  - id: records
    type: record
    repeat: until
    repeat-until: _.record_type == record_type::index.to_i
    doc: All records up to and including the INDEX record, which is the last one.
  - id: footer
    type: footer
instances:
  footer_at_end:
    pos: _io.size - 48
    type: footer
    doc: |
      The footer read from the end of the file, the entry point for random
      access: its `index_offset` locates the INDEX record. In a complete image it
      is the same footer as `footer`.
types:
  header:
    doc-ref: spec/format.md §3
    seq:
      - id: magic
        contents: [0x89, LEANIMG]
      - id: major_version
        type: u2
        valid: 1
        doc: A reader refuses any other major version.
      - id: minor_version
        type: u2
        doc: |
          A reader of major version 1 accepts any minor version. 1 in an image
          that sets INHERITED_DIGESTS (a feature of version 1.1), else 0.
      - id: header_length
        type: u4
        valid:
          expr: _ >= 104 and _ <= 4096 and _ % 8 == 0
        doc: |
          Length of the header in bytes, where the first record starts. The
          header grows only by appending fields.
      - id: incompatible_features
        type: u8
        valid:
          max: 15
        doc: |
          Bit 0 PARENT (the image needs its parent), bit 1 DISK (DISK pages
          present), bit 2 DELTA (DELTA pages present), bit 3 INHERITED_DIGESTS
          (version 1.1, only with PARENT: PARENT pages have no stored digest,
          theirs is the parent's digest of the same page). A reader refuses an
          image with a bit it does not know, so a 1.0 reader refuses 1.1 children.
      - id: compatible_features
        type: u8
        doc: Bit 0 SOURCE_STATE (SOURCE_STATE records present). Unknown bits are ignored.
      - id: autoclear_features
        type: u8
        doc: None defined; a writer modifying an image clears the bits it does not know.
      - id: image_uuid
        size: 16
        doc: Random UUID of this image, RFC 4122 byte order.
      - id: parent_uuid
        size: 16
        doc: image_uuid of the parent image; all zero when there is no parent.
      - id: parent_digest
        size: 16
        doc: image_digest of the parent's footer; all zero when there is no parent.
      - id: page_size
        type: u4
        valid:
          any-of: [4096, 8192, 16384, 32768, 65536]
      - id: reserved
        type: u4
        valid: 0
      - id: header_checksum
        type: u8
        doc: xxh3-64 of the header_length header bytes with these 8 bytes zeroed.
      - id: extension
        type: u1
        repeat: expr
        repeat-expr: header_length - 104
        valid:
          expr: minor_version > 1 or _ == 0
        doc: |
          Header bytes past the 104 bytes of versions 1.0 and 1.1: zero when
          minor_version is 0 or 1; fields a later minor version appended
          otherwise, which a 1.1 reader ignores (a zero field means the same as
          an absent one).
    instances:
      has_parent:
        value: (incompatible_features & 1) != 0
      has_disk_pages:
        value: (incompatible_features & 2) != 0
      has_delta_pages:
        value: (incompatible_features & 4) != 0
      has_source_state:
        value: (compatible_features & 1) != 0
      inherits_digests:
        value: (incompatible_features & 8) != 0
        doc: PARENT pages are not digest-bearing (format 1.1).

  record:
    doc: |
      Every record starts on an 8-byte boundary: a 16-byte record header,
      the body, zero padding to a multiple of 8, and a checksum. A record type
      with bit 31 set is optional: a reader skips it when it does not know
      the type, and refuses an unknown mandatory record.
    doc-ref: spec/format.md §4
    seq:
      - id: record_type
        type: u4
        valid:
          expr: >-
            (_ & 0x8000_0000) != 0
            or _ == record_type::region.to_i or _ == record_type::disk.to_i
            or _ == record_type::page_frame.to_i or _ == record_type::delta_frame.to_i
            or _ == record_type::disk_refs.to_i or _ == record_type::page_map.to_i
            or _ == record_type::digests.to_i or _ == record_type::index.to_i
        doc: |
          Bit 31 set marks an optional record; a mandatory type must be known.
          An integer, as the set is open: `known_type` is the enum value.
      - id: flags
        type: u4
        valid: 0
      - id: body_length
        type: u8
      - id: body
        size: body_length
        type:
          switch-on: known_type
          cases:
            record_type::region: region_body
            record_type::disk: disk_body
            record_type::source_state: source_state_body
            record_type::page_frame: page_frame_body
            record_type::delta_frame: delta_frame_body
            record_type::disk_refs: disk_refs_body
            record_type::page_map: page_map_body
            record_type::digests: digests_body
            record_type::index: index_body
      - id: padding
        type: u1
        repeat: expr
        repeat-expr: (8 - body_length % 8) % 8
        valid: 0
      - id: record_checksum
        type: u8
        doc: xxh3-64 of the record header, body and padding.
    instances:
      known_type:
        value: record_type
        enum: record_type
        doc: |
          record_type as an enum value. A type this description does not name
          stays a number in most target languages; in Java it is null, so
          record_type itself is an integer field.
      is_optional:
        value: (record_type & 0x8000_0000) != 0

  region_body:
    doc: A named RAM block of the guest (QEMU `pc.ram`, `vga.vram`, ...; Xen's pfn space).
    doc-ref: spec/format.md §5
    seq:
      - id: region_id
        type: u4
        doc: Unique among the image's regions.
      - id: flags
        type: u4
        valid:
          max: 1
        doc: Bit 0 HAS_GPA; the other bits are zero.
      - id: guest_phys_base
        type: u8
        valid:
          expr: (flags & 1) != 0 or _ == 0
        doc: Guest-physical address of the region; zero unless HAS_GPA.
      - id: size_bytes
        type: u8
        valid:
          expr: _ != 0 and _ % _root.header.page_size == 0 and _ <= 0x1_0000_0000_0000
        doc: |
          A multiple of page_size, at most 2^48 (a literal: `1 << 48` is 65536
          in the JavaScript and Java parsers, which shift 32-bit integers).
      - id: name_length
        type: u4
        valid:
          min: 1
          max: 255
      - id: reserved
        type: u4
        valid: 0
      - id: name
        type: str
        size: name_length
        doc: Unique among the image's regions.

  disk_body:
    doc: A disk image that DISK pages refer to, identified by its size and a sampled fingerprint.
    doc-ref: spec/format.md §5
    seq:
      - id: disk_id
        type: u4
        doc: Unique among the image's disks.
      - id: flags
        type: u4
        valid: 0
      - id: size_bytes
        type: u8
        valid:
          min: 1
      - id: sector_size
        type: u4
        valid: 512
      - id: fingerprint_method
        type: u4
        valid: 1
        doc: |
          1: xxh3-128 over the size as u8 LE, then for k in 0..63 the bytes
          [o_k, min(o_k + 4096, size)) with o_k = (size * k // 64) rounded
          down to a multiple of 512.
      - id: fingerprint
        size: 16
      - id: name_length
        type: u4
        valid:
          min: 1
          max: 255
      - id: reserved
        type: u4
        valid: 0
      - id: name
        type: str
        size: name_length
        doc: Unique among the image's disks.

  source_state_body:
    doc: |
      Opaque device state of the save file the image was made from (QEMU
      device sections, Xen non-page records), kept verbatim so that the save
      file can be rebuilt.
    doc-ref: spec/format.md §5
    seq:
      - id: source_format
        type: u4
        valid:
          expr: _ == source_format::qemu.to_i or _ == source_format::xen.to_i or _ >= 0x80000000
        doc: |
          1 QEMU, 2 Xen, 0x80000000 and above private to a converter (an
          integer, as the set is open: `known_format` is the enum value).
      - id: tag
        type: u4
        doc: |
          Meaning defined and documented by the converter that wrote it;
          readers keep records with tags they do not know untouched. QEMU
          tag 1: the converter's QEMU stream state, one zstd frame with its
          content size declared.
      - id: sequence
        type: u8
        doc: 0, 1, 2, ... across all SOURCE_STATE records in file order.
      - id: data
        size-eos: true
    instances:
      known_format:
        value: source_format
        enum: source_format
        doc: source_format as an enum value (null in Java for a private format).

  page_frame_body:
    doc: |
      Stored pages, compressed as one zstd frame. Ordinals are global across
      the image: the frames in file order number their pages contiguously
      from 0. Ordinal k holds bytes [(k - first_ordinal) * page_size,
      +page_size) of the decompressed content.
    doc-ref: spec/format.md §6
    seq:
      - id: first_ordinal
        type: u8
      - id: num_pages
        type: u4
        valid:
          expr: _ >= 1 and _ * _root.header.page_size <= 16 * 1024 * 1024
      - id: reserved
        type: u4
        valid: 0
      - id: frame
        size-eos: true
        type: zstd_frame
        valid:
          expr: _.has_content_size and _.content_size == num_pages * _root.header.page_size

  delta_frame_body:
    doc: |
      Delta entries, concatenated and compressed as one zstd frame. Deltas
      are numbered contiguously from 0 across the frames in file order;
      entry i of this frame is content[entry_offsets[i]:entry_offsets[i + 1]]
      and is parsed as `delta_entry`.
    doc-ref: spec/format.md §6
    seq:
      - id: first_delta
        type: u8
      - id: num_deltas
        type: u4
        valid:
          min: 1
      - id: reserved
        type: u4
        valid: 0
      - id: entry_offsets
        type: u4
        repeat: expr
        repeat-expr: num_deltas + 1
        doc: Offsets into the decompressed content, starting at 0, never decreasing.
      - id: padding
        type: u1
        repeat: expr
        repeat-expr: (num_deltas + 1) % 2 * 4
        valid: 0
        doc: |
          Aligns the zstd frame to 8 bytes from the start of the body, which
          the 16 bytes of fields and 4 bytes per offset leave at 0 or 4. (Not
          computed from _io.pos: the Java and JavaScript parsers evaluate a
          repeat-expr again after each element.)
      - id: frame
        size-eos: true
        type: zstd_frame
        valid:
          # .as<u4>: the Java parser would compare two boxed Longs by identity
          expr: _.has_content_size and _.content_size == entry_offsets.last.as<u4> and entry_offsets.first == 0

  disk_refs_body:
    doc: |
      Disk references, numbered contiguously from 0 across the DISK_REFS
      records in file order.
    doc-ref: spec/format.md §5
    seq:
      - id: first_ref
        type: u8
      - id: num_refs
        type: u4
        valid:
          min: 1
      - id: reserved
        type: u4
        valid: 0
      - id: refs
        type: disk_ref
        repeat: expr
        repeat-expr: num_refs

  disk_ref:
    doc: The page_size bytes of a disk starting at sector * 512; they lie within the disk.
    doc-ref: spec/format.md §5
    seq:
      - id: disk_id
        type: u4
      - id: reserved
        type: u4
        valid: 0
      - id: sector
        type: u8

  page_map_body:
    doc: |
      Extents of one region. Concatenated in file order, the extents of all
      PAGE_MAP records of a region cover it exactly: from page 0, each
      extent starting where the previous one ended.
    doc-ref: spec/format.md §6
    seq:
      - id: region_id
        type: u4
      - id: num_extents
        type: u4
        valid:
          min: 1
      - id: extents
        type: extent
        repeat: expr
        repeat-expr: num_extents

  extent:
    doc: |
      A run of pages of one class. Page first_page + i has slot
      first_slot + i: the stored ordinal (STORED), the disk reference
      (DISK) or the delta entry (DELTA).
    doc-ref: spec/format.md §6
    seq:
      - id: first_page
        type: u8
      - id: num_pages
        type: u4
        valid:
          min: 1
      - id: page_class
        type: u2
        enum: page_class
        valid:
          any-of:
            - page_class::stored
            - page_class::zero
            - page_class::free
            - page_class::disk
            - page_class::parent
            - page_class::delta
      - id: reserved
        type: u2
        valid: 0
      - id: first_slot
        type: u8
        valid:
          expr: >-
            page_class == page_class::stored or page_class == page_class::disk
            or page_class == page_class::delta or _ == 0

  digests_body:
    doc: |
      Covers pages [first_page, first_page + num_pages) of one region and
      holds the xxh3-128 digests (canonical, big-endian) of the restored
      content of the digest-bearing pages of that range, in page order:
      STORED, DISK and DELTA pages, and PARENT pages unless the header's
      INHERITED_DIGESTS bit is set (then a PARENT page's digest is the
      parent's digest of the same page). ZERO pages have no stored digest
      (theirs is implied: the digest of page_size zero bytes); FREE pages
      have none. Which digest
      belongs to which page follows from the page map: a page's digest is
      found by its rank among the region's digest-bearing pages. A region's
      DIGESTS records, in file order, cover it exactly once.
    doc-ref: spec/format.md §6
    seq:
      - id: region_id
        type: u4
      - id: num_digests
        type: u4
        doc: |
          Number of digest-bearing pages in the range (STORED, DISK, DELTA;
          PARENT unless INHERITED_DIGESTS) (not checkable here: it needs the
          page map); at most num_pages.
      - id: first_page
        type: u8
      - id: num_pages
        type: u8
        valid:
          expr: _ >= 1 and _ >= num_digests
      - id: digests
        size: 16
        repeat: expr
        repeat-expr: num_digests
        doc: One digest per digest-bearing page of the range, in page order.

  index_body:
    doc: The last record; one entry per other record, in file order.
    doc-ref: spec/format.md §8
    seq:
      - id: num_entries
        type: u4
      - id: reserved
        type: u4
        valid: 0
      - id: entries
        type: index_entry
        repeat: expr
        repeat-expr: num_entries

  index_entry:
    doc: |
      key, first and count by record type: REGION region_id, 0, pages;
      DISK disk_id, 0, sectors; SOURCE_STATE tag, sequence, data length;
      PAGE_FRAME 0xFFFFFFFF, first_ordinal, num_pages; DELTA_FRAME
      0xFFFFFFFF, first_delta, num_deltas; DISK_REFS 0xFFFFFFFF, first_ref,
      num_refs; PAGE_MAP region_id, first page, total pages of its extents;
      DIGESTS region_id, first_page, num_pages; unknown optional records
      0xFFFFFFFF, 0, 0.
    doc-ref: spec/format.md §8
    seq:
      - id: record_offset
        type: u8
      - id: record_type
        type: u4
        doc: The record's record_type (an integer, as the set is open).
      - id: key
        type: u4
      - id: first
        type: u8
      - id: count
        type: u8
    instances:
      record:
        io: _root._io
        pos: record_offset
        type: record

  footer:
    doc: The last 48 bytes of the file.
    doc-ref: spec/format.md §8
    seq:
      - id: magic
        contents: [0x89, LEANEND]
      - id: index_offset
        type: u8
        doc: Offset of the INDEX record.
      - id: file_length
        type: u8
        valid:
          expr: _ == _root._io.size and _io.pos == _ - 24
        doc: |
          The file size. The footer is the last 48 bytes, so after this field
          (24 bytes into the footer) the position is file_length - 24.
      - id: image_digest
        size: 16
        doc: xxh3-128 of all bytes before the footer.
      - id: footer_checksum
        type: u8
        doc: xxh3-64 of the footer's first 40 bytes.
    instances:
      index:
        io: _root._io
        pos: index_offset
        type: record

  zstd_frame:
    doc: |
      The start of a Zstandard frame, as far as needed to read the content
      size it declares.
    doc-ref: https://www.rfc-editor.org/rfc/rfc8878#section-3.1.1
    seq:
      - id: magic
        contents: [0x28, 0xb5, 0x2f, 0xfd]
      - id: fcs_flag
        type: b2
      - id: single_segment
        type: b1
      - id: unused_bit
        type: b1
      - id: reserved_bit
        type: b1
        valid: false
      - id: has_checksum
        type: b1
      - id: dictionary_id_flag
        type: b2
      - id: window_descriptor
        type: u1
        if: not single_segment
      - id: dictionary_id
        type:
          # .as<u1>: Java cannot switch on the long a bit field is read into
          switch-on: dictionary_id_flag.as<u1>
          cases:
            1: u1
            2: u2
            3: u4
        if: dictionary_id_flag != 0
      - id: fcs_field
        type:
          switch-on: fcs_flag.as<u1>
          cases:
            0: u1
            1: u2
            2: u4
            3: u8
        if: has_content_size
      - id: blocks
        size-eos: true
        doc: The frame's blocks and optional content checksum.
    instances:
      has_content_size:
        value: fcs_flag != 0 or single_segment
      content_size:
        # .as<u8>: the Java parser would narrow the sum to an int
        value: '(fcs_flag == 1 ? fcs_field + 256 : fcs_field).as<u8>'
        if: has_content_size

  delta_entry:
    doc: |
      One changed page relative to the parent's page: the new values of
      num_words changed 8-byte words. Not reached from the file's structure
      (it lives in decompressed content); a tool decompresses a DELTA_FRAME
      and parses entry i, content[entry_offsets[i]:entry_offsets[i + 1]],
      with this type.
    doc-ref: spec/format.md §7
    params:
      - id: page_size
        type: u4
    seq:
      - id: encoding
        type: u1
        enum: delta_encoding
        valid:
          any-of:
            - delta_encoding::index_list
            - delta_encoding::bitmap
            - delta_encoding::runs
      - id: reserved
        type: u1
        valid: 0
      - id: num_words
        type: u2
        valid:
          min: 1
      - id: word_indexes
        type: u2
        repeat: expr
        repeat-expr: num_words
        valid:
          max: page_size / 8 - 1
        if: encoding == delta_encoding::index_list
        doc: Strictly ascending.
      - id: bitmap
        size: page_size / 64
        if: encoding == delta_encoding::bitmap
        doc: Bit i (byte i / 8, LSB first) set when word i changed; num_words bits set.
      - id: num_runs
        type: u2
        valid:
          min: 1
        if: encoding == delta_encoding::runs
      - id: runs
        type: delta_run
        repeat: expr
        repeat-expr: num_runs
        if: encoding == delta_encoding::runs
        doc: Ascending, not touching; their lengths add up to num_words.
      - id: values
        type: u8
        repeat: expr
        repeat-expr: num_words
        doc: New values of the changed words, in ascending word order.

  delta_run:
    doc-ref: spec/format.md §7
    seq:
      - id: start_word
        type: u2
      - id: run_length
        type: u2
        valid:
          min: 1

enums:
  record_type:
    0x1:
      id: region
      doc: A RAM region of the guest.
    0x2:
      id: disk
      doc: A disk that DISK pages refer to.
    0x10:
      id: page_frame
      doc: Stored pages in one zstd frame.
    0x11:
      id: delta_frame
      doc: Delta entries in one zstd frame.
    0x12:
      id: disk_refs
      doc: Disk references of DISK pages.
    0x20:
      id: page_map
      doc: Extents mapping a region's pages to their classes and slots.
    0x21:
      id: digests
      doc: Page digests of a region.
    0xff:
      id: index
      doc: The last record, listing all others.
    0x80000003:
      id: source_state
      doc: Opaque device state of the source save file (optional record).
  page_class:
    0x1:
      id: stored
      doc: In a PAGE_FRAME; slot = stored ordinal.
    0x2:
      id: zero
      doc: All zero bytes; digest implied, not stored.
    0x3:
      id: free
      doc: Content undefined; restored as zeros; no digest.
    0x4:
      id: disk
      doc: From a disk; slot = disk reference.
    0x5:
      id: parent
      doc: The same page of the parent image.
    0x6:
      id: delta
      doc: The parent's page with changed words; slot = delta entry.
  delta_encoding:
    0x1: index_list
    0x2: bitmap
    0x3: runs
  source_format:
    0x1: qemu
    0x2: xen
