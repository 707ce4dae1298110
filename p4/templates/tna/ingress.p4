#ifdef THC_TESTGEN_RECIRC_PORT
// `thc p4 testgen` only: whether a count << 24 | bitmap word is one a round of n workers has
// (count = the bitmap's bits, all below n), for the assumptions in pass 2 below
bool testgen_cb_ok(in bit<32> cb, in bit<8> n) {
    return cb[31:24] >= 1 && cb[31:24] <= n && ((bit<32>)cb[23:0] >> (bit<32>)n) == 0
        && cb[31:24] == (bit<8>)cb[0:0] + (bit<8>)cb[1:1] + (bit<8>)cb[2:2] + (bit<8>)cb[3:3] + (bit<8>)cb[4:4] + (bit<8>)cb[5:5]
            + (bit<8>)cb[6:6] + (bit<8>)cb[7:7] + (bit<8>)cb[8:8] + (bit<8>)cb[9:9] + (bit<8>)cb[10:10] + (bit<8>)cb[11:11]
            + (bit<8>)cb[12:12] + (bit<8>)cb[13:13] + (bit<8>)cb[14:14] + (bit<8>)cb[15:15] + (bit<8>)cb[16:16] + (bit<8>)cb[17:17]
            + (bit<8>)cb[18:18] + (bit<8>)cb[19:19] + (bit<8>)cb[20:20] + (bit<8>)cb[21:21] + (bit<8>)cb[22:22] + (bit<8>)cb[23:23];
}
#endif

control ThcIngress(inout headers_t hdr, inout metadata_t meta,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    // Each event counter is addressed once per packet and pass on Tofino: `events` counts the
    // packet's outcome once (in pass 1 for what pass 1 finishes, else in pass 2),
    // `extra_events` the second event a few packets have (a partial round, a late
    // contribution).  The control plane adds the two per index.
    Counter<bit<32>, event_t>($event_cells, CounterType_t.PACKETS) events;
    Counter<bit<32>, event_t>($event_cells, CounterType_t.PACKETS) extra_events;

    // ---- the job: job id and nonce are the key; a miss is `unknown_job`
    action set_job(bit<8> n, bit<8> quorum, bit<32> quorum_cb, mac_addr_t ps_mac, PortId_t recirc_port) {
        meta.job_ok = 1;
        meta.recirc_port = recirc_port;
        meta.n = n;
        meta.quorum = quorum;
        meta.quorum_cb = quorum_cb;
        meta.ps_mac = ps_mac;
    }
    action no_job() {
        meta.job_ok = 0;
    }
    table thc_job {
        key = {
            hdr.thc.job_id: exact;
            hdr.thc.nonce: exact;
        }
        actions = { set_job; no_job; }
        size = 4;
        default_action = no_job();
    }

    // ---- the job's size: (job id, nonce, n); a packet stating another n is malformed
    action n_matches() {
        meta.n_ok = 1;
    }
    action n_differs() {
        meta.n_ok = 0;
    }
    table job_size {
        key = {
            hdr.thc.job_id: exact;
            hdr.thc.nonce: exact;
            hdr.thc.num_workers: exact;
        }
        actions = { n_matches; n_differs; }
        size = 4;
        default_action = n_differs();
    }

    // ---- the job's worker ids: one range entry [0, n − 1]; a miss is `worker_out_of_range`
    action worker_in_range() {
        meta.worker_ok = 1;
    }
    action worker_out_of_range() {
        meta.worker_ok = 0;
    }
    table worker_range {
        key = { hdr.thc.worker_id: range; }
        actions = { worker_in_range; worker_out_of_range; }
        size = 4;
        default_action = worker_out_of_range();
    }

    // ---- the job's slots: (DATA, [0, S − 1]) and (NORM, [S, S + S_norm − 1]); a miss is `slot_out_of_range`
    action slot_in_range() {
        meta.slot_ok = 1;
    }
    action slot_out_of_range() {
        meta.slot_ok = 0;
    }
    table slot_range {
        key = {
            hdr.thc.type: exact;
            hdr.thc.slot: range;
        }
        actions = { slot_in_range; slot_out_of_range; }
        size = 4;
        default_action = slot_out_of_range();
    }

    // ---- a registration: source address, port, the token the control plane handed out and
    // the worker id it was given
    action set_worker(bit<32> me) {
        meta.registered = 1;
        meta.me = me;
        meta.me_cb = me | ONE_CONTRIBUTOR;
    }
    action unknown_worker() {
        meta.registered = 0;
    }
    table workers {
        key = {
            hdr.ipv4.src: exact;
            hdr.udp.src_port: exact;
            hdr.thc.token: exact;
            hdr.thc.worker_id: exact;
        }
        actions = { set_worker; unknown_worker; }
        size = 64;
        default_action = unknown_worker();
    }

    // ---- plain L2 forwarding of everything that is not THC
    action forward(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
    }
    action drop_other() {
        ig_dprsr_md.drop_ctl = 1;
    }
    table l2 {
        key = { hdr.eth.dst: exact; }
        actions = { forward; drop_other; }
        size = 64;
        default_action = drop_other();
    }

    // ---- per lane: index -> table value (16 entries, written from T by the control plane)
$lookup_tables

    // ---- per-slot state (index: slot).  One RegisterAction runs per register per packet (each
    // register belongs to one pass).
    // The slot's round + 1 (0: not used yet).  Below ROUND_WINDOW a round can never be ahead.
    Register<round_t, slot_index_t>($slots, 0) round_reg;
    RegisterAction<round_t, slot_index_t, round_t>(round_reg) round_near = {
        void apply(inout round_t cell, out round_t last) {
            last = cell;
            if (cell <= hdr.thc.round) {
                cell = hdr.thc.round + 1;
            }
        }
    };
    // Above it, a round more than ROUND_WINDOW ahead leaves the slot alone (the SALU compares
    // in 34 bits, so this is the software PS's unsigned test, without wrapping).  The output
    // is the old cell in every branch (a SALU output has one source on Tofino); the MAU tells
    // "too far ahead" from round |-| last >= ROUND_WINDOW, the same test (see apply).
    RegisterAction<round_t, slot_index_t, round_t>(round_reg) round_far = {
        void apply(inout round_t cell, out round_t last) {
            last = cell;
            if (cell <= hdr.thc.round && cell + (ROUND_WINDOW - 1) >= hdr.thc.round) {
                cell = hdr.thc.round + 1;
            }
        }
    };

    Register<bit<32>, slot_index_t>($slots, 0) offset_reg;
    RegisterAction<bit<32>, slot_index_t, bit<32>>(offset_reg) offset_swap = {
        void apply(inout bit<32> cell, out bit<32> old) {
            old = cell;
            cell = hdr.thc.offset;
        }
    };
    // 0 when the packet's offset is the slot's (the comparison in the stateful ALU saves the
    // stage a gateway comparing two 32-bit fields would take)
    RegisterAction<bit<32>, slot_index_t, bit<32>>(offset_reg) offset_cmp = {
        void apply(inout bit<32> cell, out bit<32> diff) {
            diff = cell - hdr.thc.offset;
        }
    };

    // every worker that sent this round (late ones too): keeps a retransmission from adding twice
    Register<bit<32>, slot_index_t>($slots, 0) arrived_reg;
    RegisterAction<bit<32>, slot_index_t, bit<32>>(arrived_reg) arrived_start = {
        void apply(inout bit<32> cell) {
            cell = meta.me;
        }
    };
    // returns the sender's bit as it was (0: its first packet of this round), then sets it
    RegisterAction<bit<32>, slot_index_t, bit<32>>(arrived_reg) arrived_add = {
        void apply(inout bit<32> cell, out bit<32> seen) {
            seen = cell & meta.me;
            cell = cell | meta.me;
        }
    };

    // the contributors: count << 24 | bitmap; adding ONE_CONTRIBUTOR | me is "count + 1, set my bit"
    Register<bit<32>, slot_index_t>($slots, 0) contrib_reg;
    RegisterAction<bit<32>, slot_index_t, bit<32>>(contrib_reg) contrib_start = {
        void apply(inout bit<32> cell, out bit<32> kept) {
            kept = 0;
            cell = meta.me_cb;
        }
    };
    RegisterAction<bit<32>, slot_index_t, bit<32>>(contrib_reg) contrib_start_keep = {
        void apply(inout bit<32> cell, out bit<32> kept) {
            if (cell >= meta.quorum_cb) {
                kept = cell;
            } else {
                kept = 0;
            }
            cell = meta.me_cb;
        }
    };
    RegisterAction<bit<32>, slot_index_t, bit<32>>(contrib_reg) contrib_add = {
        void apply(inout bit<32> cell, out bit<32> now) {
            if (cell < meta.quorum_cb) {
                cell = cell + meta.me_cb;
            }
            now = cell;
        }
    };
    RegisterAction<bit<32>, slot_index_t, bit<32>>(contrib_reg) contrib_get = {
        void apply(inout bit<32> cell, out bit<32> now) {
            now = cell;
        }
    };

    // the shadow copy's contributors and offset (the lane sums stay in the other bank); pass 2
    // saves it from what pass 1 read (the bridge) and reads it for a previous-round packet (whose
    // offset pass 1 put in bridge.off_old: a stateful ALU takes two PHV inputs)
    Register<shadow_t, slot_index_t>($slots) shadow_reg;
    RegisterAction<shadow_t, slot_index_t, bit<32>>(shadow_reg) shadow_save = {
        void apply(inout shadow_t cell) {
            cell.cb = hdr.bridge.shadow_cb;
            cell.offset = hdr.bridge.off_old;
        }
    };
    RegisterAction<shadow_t, slot_index_t, bit<32>>(shadow_reg) shadow_get = {
        void apply(inout shadow_t cell, out bit<32> cb) {
            if (cell.offset == hdr.bridge.off_old) {
                cb = cell.cb;
            } else {
                cb = 0;
            }
        }
    };

    // ---- lane sums (index: 2·slot + round parity), four lanes per 32-bit cell
$word_registers

    Register<bit<32>, bank_index_t>($banks, 0) norm_acc;
    RegisterAction<bit<32>, bank_index_t, bit<32>>(norm_acc) norm_set = {
        void apply(inout bit<32> cell, out bit<32> top) {
            cell = hdr.norm.v;
            top = cell;
        }
    };
    RegisterAction<bit<32>, bank_index_t, bit<32>>(norm_acc) norm_max = {
        void apply(inout bit<32> cell, out bit<32> top) {
            if (hdr.norm.v > cell) {
                cell = hdr.norm.v;
            }
            top = cell;
        }
    };
    RegisterAction<bit<32>, bank_index_t, bit<32>>(norm_acc) norm_get = {
        void apply(inout bit<32> cell, out bit<32> top) {
            top = cell;
        }
    };

    // ---- indices and the actions of the outputs
    action slot_indices() {
        meta.round_plus_one = hdr.thc.round + 1;
        meta.bank_idx = hdr.thc.slot ++ hdr.thc.round[0:0];
    }

    // Reply to the sender: swap addresses, send back out of the ingress port.
    action bounce() {
        mac_addr_t m = hdr.eth.dst;
        hdr.eth.dst = hdr.eth.src;
        hdr.eth.src = m;
        ipv4_addr_t a = hdr.ipv4.dst;
        hdr.ipv4.dst = hdr.ipv4.src;
        hdr.ipv4.src = a;
        bit<16> p = hdr.udp.dst_port;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = p;
        hdr.udp.checksum = 0;
        ig_tm_md.ucast_egress_port = meta.reply_port;
    }

    // the result's contributors, from bridge.cb (count << 24 | bitmap): two actions in two
    // keyless tables, because one action writing both would need more sources than a
    // Tofino action has (the count shares its container with `op` and `reserved`)
    action set_count() {
        hdr.thc.contributors = hdr.bridge.cb[31:24];
    }
    table count_tbl {
        actions = { set_count; }
        default_action = set_count();
        size = 1;
    }
    action set_bitmap() {
        hdr.thc.bitmap = (bit<32>)hdr.bridge.cb[23:0];
    }
    table bitmap_tbl {
        actions = { set_bitmap; }
        default_action = set_bitmap();
        size = 1;
    }

    // DATA -> RESULT in place: header fields and payload (indices out, lane sums in).
    action data_to_result() {
        hdr.udp.checksum = 0;
        hdr.thc.type = T_RESULT;
        hdr.thc.elem_bits = 8;
        hdr.thc.payload_len = SUM_BYTES;
        hdr.idx.setInvalid();
        hdr.ipv4.total_len = hdr.ipv4.total_len + (SUM_BYTES - IDX_BYTES);
        hdr.udp.length = hdr.udp.length + (SUM_BYTES - IDX_BYTES);
    }

    // NORM -> NORM_RESULT in place: the payload already holds the maximum.
    action norm_to_result() {
        hdr.udp.checksum = 0;
        hdr.thc.type = T_NORM_RESULT;
    }

    action to_straggler() {
        bit<16> payload = hdr.thc.payload_len;
        hdr.thc.type = T_STRAGGLER;
        hdr.thc.flags = 0;
        hdr.thc.elem_bits = 0;
        hdr.thc.count = 0;
        hdr.thc.payload_len = 0;
        hdr.thc.bitmap = 0;
        hdr.thc.contributors = 0;
        hdr.idx.setInvalid();
        hdr.norm.setInvalid();
        hdr.ipv4.total_len = hdr.ipv4.total_len - payload;
        hdr.udp.length = hdr.udp.length - payload;
    }

    // ---- the two packet shapes the switch aggregates (more header bytes than one gateway
    // compares, so a table); anything else of type DATA or NORM is malformed
    action shape_is_ok() {
        meta.shape_ok = 1;
    }
    action shape_is_bad() {
        meta.shape_ok = 0;
    }
    table shape {
        key = {
            hdr.thc.magic: exact;
            hdr.thc.version: exact;
            hdr.thc.type: exact;
            hdr.thc.elem_bits: exact;
            hdr.thc.op: exact;
            hdr.thc.count: exact;
            hdr.thc.payload_len: exact;
            hdr.udp.length: exact;
        }
        actions = { shape_is_ok; shape_is_bad; }
        const entries = {
            (THC_MAGIC, THC_VERSION, T_DATA, 4, OP_LOOKUP_SUM, LANES, IDX_BYTES, 8 + HDR_BYTES + IDX_BYTES) : shape_is_ok();
            (THC_MAGIC, THC_VERSION, T_NORM, 32, OP_MAX_U32, 1, 4, 8 + HDR_BYTES + 4) : shape_is_ok();
        }
        default_action = shape_is_bad();
        size = 2;
    }

    // ---- validation in the software PS's order, as one first-match table over the checks
    // above (a chain of gateways would take a stage per test): the event of a packet that
    // fails, C_NONE for one that passes
    action check(event_t e) {
        meta.event = e;
    }
    table checks {
        key = {
            ig_prsr_md.parser_err: ternary;
            hdr.thc.magic: ternary;
            hdr.thc.version: ternary;
            hdr.thc.type: ternary;
            meta.job_ok: ternary;
            meta.worker_ok: ternary;
            meta.registered: ternary;
            meta.slot_ok: ternary;
            meta.shape_ok: ternary;
            meta.n_ok: ternary;
        }
        actions = { check; }
        const entries = {
            (0, THC_MAGIC, THC_VERSION, T_DATA, 1, 1, 1, 1, 1, 1) : check(C_NONE);
            (0, THC_MAGIC, THC_VERSION, T_NORM, 1, 1, 1, 1, 1, 1) : check(C_NONE);
            (0, THC_MAGIC, THC_VERSION, T_DATA, 1, 1, 1, 1, _, _) : check(C_MALFORMED);
            (0, THC_MAGIC, THC_VERSION, T_NORM, 1, 1, 1, 1, _, _) : check(C_MALFORMED);
            (0, THC_MAGIC, THC_VERSION, T_DATA, 1, 1, 1, _, _, _) : check(C_SLOT_OUT_OF_RANGE);
            (0, THC_MAGIC, THC_VERSION, T_NORM, 1, 1, 1, _, _, _) : check(C_SLOT_OUT_OF_RANGE);
            (0, THC_MAGIC, THC_VERSION, T_DATA, 1, 1, _, _, _, _) : check(C_UNREGISTERED);
            (0, THC_MAGIC, THC_VERSION, T_NORM, 1, 1, _, _, _, _) : check(C_UNREGISTERED);
            (0, THC_MAGIC, THC_VERSION, T_DATA, 1, _, _, _, _, _) : check(C_WORKER_OUT_OF_RANGE);
            (0, THC_MAGIC, THC_VERSION, T_NORM, 1, _, _, _, _, _) : check(C_WORKER_OUT_OF_RANGE);
            (0, THC_MAGIC, THC_VERSION, T_DATA, _, _, _, _, _, _) : check(C_UNKNOWN_JOB);
            (0, THC_MAGIC, THC_VERSION, T_NORM, _, _, _, _, _, _) : check(C_UNKNOWN_JOB);
            (0, THC_MAGIC, THC_VERSION, _, _, _, _, _, _, _) : check(C_MALFORMED);
            (0, THC_MAGIC, _, _, _, _, _, _, _, _) : check(C_WRONG_VERSION);
        }
        default_action = check(C_MALFORMED);       // a parser error or the wrong magic
        size = 16;
    }

    // ---- narrow flags for the gateways.  Tofino's `if` hardware (a gateway) takes at most 4
    // bytes + 12 bits of PHV and compares fields with constants, so arithmetic and
    // field-with-field tests are computed by actions of keyless tables (which the front end
    // does not fold back into the conditions) and the round classification is a table.
    action round_near_side() {
        meta.far = 0;
    }
    action round_far_side() {
        meta.far = 1;
    }
    table round_class {
        key = { hdr.thc.round: ternary; }     // 0 … ROUND_WINDOW (range keys: 20 bits at most)
        actions = { round_near_side; round_far_side; }
        const entries = {
            0 &&& GAP_SMALL_MASK : round_near_side();
            ROUND_WINDOW : round_near_side();
        }
        default_action = round_far_side();
        size = 2;
    }

    action round_math() {
        meta.slot_round = meta.last - 1;
        meta.diff = meta.round_plus_one - meta.last;
        meta.gap = hdr.thc.round |-| meta.last;      // 0 when last > round: no wrap
    }
    table round_math_tbl {
        actions = { round_math; }
        default_action = round_math();
        size = 1;
    }

    // How the packet's round relates to the slot's, in the software PS's order (first match):
    // an unused slot (last = 0) is new, or too far ahead above ROUND_WINDOW (round_far left
    // it alone); a gap of ROUND_WINDOW or more is too far ahead; diff 0 is the same round,
    // −1 the previous one; diff 1 … ROUND_WINDOW a new round (diff 1: the next one, whose
    // completed predecessor the shadow copy keeps); anything else is stale.
    action set_relation(relation_t rel, bit<1> next) {
        meta.rel = rel;
        meta.next_round = next;
    }
    table relation {
        key = {
            meta.last: ternary;
            meta.far: ternary;
            meta.gap: ternary;
            meta.diff: ternary;                 // 2 … ROUND_WINDOW as power-of-two blocks
        }
        actions = { set_relation; }
        const entries = {
            (0, 1, _, _) : set_relation(REL_AHEAD, 0);
            (0, _, _, _) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 0) : set_relation(REL_SAME, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 0xffffffff) : set_relation(REL_PREV, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 1) : set_relation(REL_NEW, 1);
            (_, _, 0 &&& GAP_SMALL_MASK, 2 &&& 0xfffffffe) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 4 &&& 0xfffffffc) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 8 &&& 0xfffffff8) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 16 &&& 0xfffffff0) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 32 &&& 0xffffffe0) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 64 &&& 0xffffffc0) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 128 &&& 0xffffff80) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 256 &&& 0xffffff00) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, 512 &&& 0xfffffe00) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, ROUND_WINDOW) : set_relation(REL_NEW, 0);
            (_, _, 0 &&& GAP_SMALL_MASK, _) : set_relation(REL_STALE, 0);
        }
        default_action = set_relation(REL_AHEAD, 0);
        size = 17;
    }

    // cb's count as 8 bits, and how many contributors are still missing to the quorum and
    // to n (saturating: 0 once reached), so the tests are 8-bit compares with 0
    action count_math() {
        meta.mine = hdr.bridge.cb & hdr.bridge.me;
        meta.count = hdr.bridge.cb[31:24];
    }
    table count_math_tbl {
        actions = { count_math; }
        default_action = count_math();
        size = 1;
    }
    action short_math() {
        meta.quorum_short = meta.quorum |-| meta.count;
        meta.n_short = meta.n |-| meta.count;
    }
    table short_math_tbl {
        actions = { short_math; }
        default_action = short_math();
        size = 1;
    }

    // ---- pass 2's verdict, first match, from what pass 1 found (the bridge) and the counts:
    // a packet whose job was removed between its passes is dropped, as the PS drops a packet
    // of an ended job; the round's first packet completes it at quorum 1; a previous round is
    // resent if its result was kept; in the current round a non-contributor is late, a
    // contributor's first packet aggregates (completing at the quorum) and its retransmission
    // is a duplicate before the quorum and a resend after it
    action set_verdict(verdict_t v) {
        meta.verdict = v;
    }
    table verdict {
        key = {
            meta.job_ok: exact;
            hdr.bridge.kind: exact;
            meta.quorum: ternary;
            hdr.bridge.cb: ternary;
            meta.mine: ternary;
            hdr.bridge.seen: ternary;
            meta.quorum_short: ternary;
        }
        actions = { set_verdict; }
        const entries = {
            (0, K_FIRST, _, _, _, _, _) : set_verdict(V_NO_JOB);
            (0, K_SAME, _, _, _, _, _) : set_verdict(V_NO_JOB);
            (0, K_PREV, _, _, _, _, _) : set_verdict(V_NO_JOB);
            (1, K_FIRST, 1, _, _, _, _) : set_verdict(V_AGG_DONE);
            (1, K_FIRST, _, _, _, _, _) : set_verdict(V_AGG);
            (1, K_PREV, _, 0, _, _, _) : set_verdict(V_STALE);
            (1, K_PREV, _, _, _, _, _) : set_verdict(V_RESEND_PREV);
            (1, K_SAME, _, _, 0, _, _) : set_verdict(V_LATE);
            (1, K_SAME, _, _, _, 0, 0) : set_verdict(V_AGG_DONE);
            (1, K_SAME, _, _, _, 0, _) : set_verdict(V_AGG);
            (1, K_SAME, _, _, _, _, 0) : set_verdict(V_RESEND_CUR);
            (1, K_SAME, _, _, _, _, _) : set_verdict(V_DUP);
        }
        default_action = set_verdict(V_DROP_MALFORMED);
        size = 12;
    }

    // a STRAGGLER notification back to the sender, carrying the slot's round
    action straggler_reply() {
        hdr.thc.token = 0;
        hdr.thc.round = meta.slot_round;
        hdr.bridge.pass2 = 0;
        to_straggler();
        bounce();
    }

    apply {
        meta.event = C_NONE;
        meta.extra_event = C_NONE;
        meta.first = 0;
        meta.rel = REL_NONE;
        meta.verdict = V_DROP_MALFORMED;
        if (!hdr.thc.isValid()) {
            l2.apply();
        } else {
          // the job: both passes need n, the quorum and the PS address
          thc_job.apply();
          if (!hdr.bridge.isValid()) {
            // ================= pass 1: validation and the slot's state =================
            // By default the packet goes on to pass 2 with the bridge header; a drop or a
            // STRAGGLER reply below clears bridge.pass2.
            meta.reply_port = ig_intr_md.ingress_port;
            ig_tm_md.ucast_egress_port = meta.recirc_port;
            workers.apply();
            job_size.apply();
            worker_range.apply();
            slot_range.apply();
            shape.apply();
            round_class.apply();
            slot_indices();
            checks.apply();                 // the event of a packet that fails, for the counters
            hdr.bridge.setValid();
            hdr.bridge.pass2 = 1;
            hdr.bridge.kind = K_NONE;
            hdr.bridge.pad = 0;
            hdr.bridge.port = ig_intr_md.ingress_port;
            hdr.bridge.me = meta.me;
            hdr.bridge.cb = meta.me_cb;
            hdr.bridge.seen = 0;
            hdr.bridge.shadow_cb = 0;
            hdr.bridge.off_old = 0;

            // ---- the slot's round: one register access decides whether the slot moves on.  The
            // gate is the checks' conjunction (a registration implies a worker id in range, a
            // job_size hit a known job), so the register runs while `checks` names the event.
            if (ig_prsr_md.parser_err == 0 && meta.shape_ok == 1 && meta.n_ok == 1 &&
                meta.registered == 1 && meta.slot_ok == 1) {
                if (meta.far == 1) {
                    meta.last = round_far.execute(hdr.thc.slot);
                } else {
                    meta.last = round_near.execute(hdr.thc.slot);
                }
                round_math_tbl.apply();
                relation.apply();
            }

            // ---- offset, arrivals, contributors: one access each, in this order
            if (meta.rel == REL_NEW) {
                hdr.bridge.kind = K_FIRST;
                hdr.bridge.off_old = offset_swap.execute(hdr.thc.slot);
                arrived_start.execute(hdr.thc.slot);
                if (meta.next_round == 1) {
                    hdr.bridge.shadow_cb = contrib_start_keep.execute(hdr.thc.slot);
                } else {
                    hdr.bridge.shadow_cb = contrib_start.execute(hdr.thc.slot);
                }
            } else if (meta.rel == REL_SAME) {
                meta.off_diff = offset_cmp.execute(hdr.thc.slot);
                if (meta.off_diff != 0) {
                    meta.event = C_MALFORMED;
                } else {
                    hdr.bridge.kind = K_SAME;
                    hdr.bridge.seen = arrived_add.execute(hdr.thc.slot);
                    if (hdr.bridge.seen == 0) {
                        hdr.bridge.cb = contrib_add.execute(hdr.thc.slot);
                    } else {
                        hdr.bridge.cb = contrib_get.execute(hdr.thc.slot);
                    }
                }
            } else if (meta.rel == REL_PREV) {
                hdr.bridge.kind = K_PREV;         // pass 2 reads the shadow copy
                hdr.bridge.off_old = hdr.thc.offset;
            } else if (meta.rel == REL_STALE) {
                meta.event = C_STALE;
                straggler_reply();
            } else if (meta.rel == REL_AHEAD) {
                meta.event = C_AHEAD;
            }
            if (meta.event != C_NONE) {
                if (meta.event != C_STALE) {
                    hdr.bridge.pass2 = 0;
                    ig_dprsr_md.drop_ctl = 1;
                }
                events.count(meta.event);
            }
          } else {
            // ================= pass 2: the shadow copy, the verdict, the lanes, the reply =================
#ifdef THC_TESTGEN_RECIRC_PORT
            // p4testgen cannot chain pass 1 into pass 2: the bridge header it makes up for a
            // pass-2 packet is held to what pass 1 writes (`thc p4 testgen` only, docs/p4.md)
            testgen_assume(hdr.bridge.pass2 == 1 && hdr.bridge.pad == 0 && hdr.bridge.port < 16
                           && hdr.bridge.kind >= K_FIRST && hdr.bridge.kind <= K_PREV
                           && (meta.job_ok == 0 || hdr.thc.worker_id < meta.n && hdr.thc.num_workers == meta.n)
                           && hdr.bridge.me == (bit<32>)1 << (bit<32>)hdr.thc.worker_id
                           && (hdr.bridge.kind == K_SAME || hdr.bridge.cb == (ONE_CONTRIBUTOR | hdr.bridge.me))
                           && (hdr.bridge.kind != K_SAME || testgen_cb_ok(hdr.bridge.cb, meta.n))
                           && (hdr.bridge.kind != K_PREV || hdr.bridge.off_old == hdr.thc.offset)
                           && (hdr.bridge.seen == 0 || hdr.bridge.kind == K_SAME && hdr.bridge.seen == hdr.bridge.me)
                           && (hdr.bridge.kind == K_FIRST || hdr.bridge.shadow_cb == 0));
            shape.apply();                  // pass 1's shape check, the one definition of it
            testgen_assume(meta.shape_ok == 1);
#endif
            meta.reply_port = hdr.bridge.port;
            hdr.bridge.pass2 = 0;
            slot_indices();
            if (hdr.idx.isValid()) {
$apply_lookups
            }
            if (hdr.bridge.kind == K_FIRST) {
                meta.first = 1;
                shadow_save.execute(hdr.thc.slot);
            } else if (hdr.bridge.kind == K_PREV) {
                hdr.bridge.cb = shadow_get.execute(hdr.thc.slot);
#ifdef THC_TESTGEN_RECIRC_PORT
                // the shadow copy keeps nothing or a round that completed
                testgen_assume(hdr.bridge.cb == 0 || testgen_cb_ok(hdr.bridge.cb, meta.n)
                               && hdr.bridge.cb[31:24] >= meta.quorum);
#endif
            }
            count_math_tbl.apply();
            short_math_tbl.apply();
            verdict.apply();

            // ---- the lanes: overwrite on a round's first packet, add, or only read for a resend
            if (hdr.thc.type == T_DATA) {
                if (meta.first == 1) {
$apply_set
                } else if (meta.verdict == V_AGG || meta.verdict == V_AGG_DONE) {
$apply_add
                } else if (meta.verdict == V_RESEND_CUR || meta.verdict == V_LATE || meta.verdict == V_RESEND_PREV) {
$apply_get
                }
            } else {
                if (meta.first == 1) {
                    hdr.norm.v = norm_set.execute(meta.bank_idx);
                } else if (meta.verdict == V_AGG || meta.verdict == V_AGG_DONE) {
                    hdr.norm.v = norm_max.execute(meta.bank_idx);
                } else if (meta.verdict == V_RESEND_CUR || meta.verdict == V_LATE || meta.verdict == V_RESEND_PREV) {
                    hdr.norm.v = norm_get.execute(meta.bank_idx);
                }
            }

            // ---- the outputs
            if (meta.verdict == V_NO_JOB) {
                // the lanes of a removed job's slot may have been written above: the next job
                // in that slot overwrites them with its first packet before it reads them
                meta.event = C_UNKNOWN_JOB;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.verdict == V_STALE) {
                // a previous round with nothing kept: the slot is at the packet's round + 1
                meta.event = C_STALE;
                meta.slot_round = meta.round_plus_one;
                straggler_reply();
            } else if (meta.verdict == V_DUP) {
                meta.event = C_DUPLICATE;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.verdict == V_AGG) {
                ig_dprsr_md.drop_ctl = 1;
            } else {
                // a result: multicast on completion, else unicast back to the sender
                hdr.thc.token = 0;
                count_tbl.apply();
                bitmap_tbl.apply();
                if (hdr.thc.type == T_DATA) {
                    hdr.sums.setValid();
                    data_to_result();
                } else {
                    norm_to_result();
                }
                if (meta.verdict == V_AGG_DONE) {
                    meta.event = C_ROUNDS_COMPLETED;
                    if (meta.n_short != 0) {
                        meta.extra_event = C_PARTIAL_ROUNDS;
                    }
                    hdr.thc.worker_id = 0;
                    hdr.thc.flags = 0;
                    // source: the PS address the workers sent to; destinations are set per replica
                    hdr.eth.src = meta.ps_mac;
                    hdr.ipv4.src = hdr.ipv4.dst;
                    hdr.udp.src_port = hdr.udp.dst_port;
                    ig_tm_md.mcast_grp_a = 1;
                } else {
                    // V_RESEND_CUR, V_LATE, V_RESEND_PREV
                    meta.event = C_RESULTS_RESENT;
                    if (meta.verdict == V_LATE) {
                        meta.extra_event = C_LATE;
                    }
                    hdr.thc.flags = F_RESENT;
                    bounce();
                }
            }
            events.count(meta.event);
            extra_events.count(meta.extra_event);
          }
        }
        if (!hdr.bridge.isValid()) {
            // leaving the switch after this pass: the egress drops the bridge header
            hdr.bridge.setValid();
            hdr.bridge.pass2 = 0;
        }
    }
}
