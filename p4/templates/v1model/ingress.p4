control ThcIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    // ---- per-slot state (index: the job's region base + slot)
    // the epoch of the job that last started a round in the slot (0: none); a slot holding
    // another epoch than the packet's job is unused to it, so a new job needs no register
    // writes to start on a clean region
    register<bit<32>>($slots) owner_reg;
    register<round_t>($slots) round_reg;
    register<bit<8>>($slots) count_reg;
    register<bit<32>>($slots) bitmap_reg;
    register<bit<32>>($slots) offset_reg;
    register<bit<1>>($slots) prev_valid_reg;
    register<bit<8>>($slots) prev_count_reg;
    register<bit<32>>($slots) prev_bitmap_reg;
    register<bit<32>>($slots) prev_offset_reg;
    // ---- lane sums (index: 2·(base + slot) + round parity)
$lane_registers
    register<bit<32>>($banks) norm_acc;
    // event counters: block 0 (EVENT_CELLS cells) counts what no job owns (malformed headers,
    // unknown job ids), block k the events of the job in job cell k (set_config's event_base)
    counter($event_counters, CounterType.packets) events;

    action count_event(event_t e) {
        events.count(meta.event_base + e);
    }

    action drop_with(event_t reason) {
        count_event(reason);
        mark_to_drop(sm);
    }

    // a running job, by its job id: its nonce, shape, region of the slot registers
    // [base, base + data_slots + norm_slots), multicast group, event counter block and epoch
    // (never 0, never that of an earlier job on the switch: the slots it owns)
    action set_config(bit<32> nonce, bit<8> n, bit<8> quorum, bit<16> base, bit<16> data_slots,
                      bit<16> norm_slots, bit<16> group, event_t event_base, mac_addr_t ps_mac,
                      bit<32> epoch) {
        meta.nonce = nonce;
        meta.n = n;
        meta.quorum = quorum;
        meta.base = base;
        meta.data_slots = data_slots;
        meta.norm_slots = norm_slots;
        meta.group = group;
        meta.event_base = event_base;
        meta.ps_mac = ps_mac;
        meta.epoch = epoch;
        meta.configured = 1;
    }
    table thc_config {
        key = { hdr.thc.job_id: exact; }
        actions = { set_config; NoAction; }
        size = $max_jobs;
        default_action = NoAction();
    }

    // a registration: the job, source address, port and the token the control plane handed out
    action set_worker(bit<8> wid) {
        meta.worker = wid;
        meta.registered = 1;
    }
    table workers {
        key = {
            hdr.thc.job_id: exact;
            hdr.ipv4.src: exact;
            hdr.udp.src_port: exact;
            hdr.thc.token: exact;
        }
        actions = { set_worker; NoAction; }
        size = $max_members;
        default_action = NoAction();
    }

    // plain L2 forwarding of everything that is not THC
    action forward(bit<9> port) {
        sm.egress_spec = port;
    }
    action drop_other() {
        mark_to_drop(sm);
    }
    table l2 {
        key = { hdr.eth.dst: exact; }
        actions = { forward; drop_other; }
        size = 64;
        default_action = drop_other();
    }

    // ---- per lane: (job, index) -> table value (16 entries per job, written from its T by the control plane)
$lookup_tables

    // The whole read-check-update of a slot in one action (atomic on bmv2).
    action slot_update() {
        bit<32> slot = meta.slot;
        bit<1> act;
        round_t r;
        bit<8> c;
        bit<32> bm;
        bit<32> off;
        bit<1> pv;
        bit<8> pc;
        bit<32> pbm;
        bit<32> poff;
        bit<32> owner;
        owner_reg.read(owner, slot);
        act = (owner == meta.epoch) ? 1w1 : 1w0;
        round_reg.read(r, slot);
        count_reg.read(c, slot);
        bitmap_reg.read(bm, slot);
        offset_reg.read(off, slot);
        prev_valid_reg.read(pv, slot);
        prev_count_reg.read(pc, slot);
        prev_bitmap_reg.read(pbm, slot);
        prev_offset_reg.read(poff, slot);
        bit<32> me = (bit<32>)1 << hdr.thc.worker_id;
        round_t pr = hdr.thc.round;
        meta.first = 0;
        meta.add = 0;
        meta.reg_idx = (slot << 1) | (bit<32>)pr[0:0];
        round_t base = (act == 0) ? 32w0 : r;
        if (pr > base + ROUND_WINDOW) {
            // no single packet may move a slot out of the workers' reach
            meta.verdict = V_AHEAD;
        } else if (act == 0 || pr > r) {
            if (act == 1 && c >= meta.quorum && pr == r + 1) {
                pv = 1;
                pc = c;
                pbm = bm;
                poff = off;
            } else {
                pv = 0;
            }
            act = 1;
            r = pr;
            c = 1;
            bm = me;
            off = hdr.thc.offset;
            meta.first = 1;
            meta.add = 1;
            meta.verdict = (c >= meta.quorum) ? V_AGG_DONE : V_AGG;
        } else if (pr == r) {
            if (hdr.thc.offset != off) {
                meta.verdict = V_DROP_MALFORMED;
            } else if ((bm & me) != 0) {
                meta.verdict = (c >= meta.quorum) ? V_RESEND_CUR : V_DUP;
            } else if (c >= meta.quorum) {
                meta.verdict = V_LATE;
            } else {
                c = c + 1;
                bm = bm | me;
                meta.add = 1;
                meta.verdict = (c >= meta.quorum) ? V_AGG_DONE : V_AGG;
            }
        } else if (pr + 1 == r && pv == 1 && hdr.thc.offset == poff) {
            meta.verdict = V_RESEND_PREV;
        } else {
            meta.verdict = V_STALE;
        }
        owner_reg.write(slot, (act == 1) ? meta.epoch : owner);
        round_reg.write(slot, r);
        count_reg.write(slot, c);
        bitmap_reg.write(slot, bm);
        offset_reg.write(slot, off);
        prev_valid_reg.write(slot, pv);
        prev_count_reg.write(slot, pc);
        prev_bitmap_reg.write(slot, pbm);
        prev_offset_reg.write(slot, poff);
        meta.cur_round = r;
        meta.cnt = c;
        meta.bm = bm;
        meta.out_k = (meta.verdict == V_RESEND_PREV) ? pc : c;
        meta.out_bm = (meta.verdict == V_RESEND_PREV) ? pbm : bm;
    }

    // ---- per lane: read, add (overwrite on a round's first packet; only read for a resend), write
$lane_actions

    action norm_lane() {
        bit<32> cur;
        norm_acc.read(cur, meta.reg_idx);
        bit<32> nv = (meta.add == 0) ? cur : ((meta.first == 1 || hdr.norm.v > cur) ? hdr.norm.v : cur);
        norm_acc.write(meta.reg_idx, nv);
        hdr.norm.v = nv;
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
        sm.egress_spec = sm.ingress_port;
    }

    // DATA -> RESULT in place: header fields and payload (indices out, lane sums in).
    action data_to_result() {
        hdr.thc.contributors = meta.out_k;
        hdr.thc.bitmap = meta.out_bm;
        hdr.udp.checksum = 0;
        hdr.thc.type = T_RESULT;
        hdr.thc.elem_bits = 8;
        hdr.thc.payload_len = SUM_BYTES;
        hdr.idx.setInvalid();
        hdr.sums.setValid();
        hdr.ipv4.total_len = hdr.ipv4.total_len + (SUM_BYTES - IDX_BYTES);
        hdr.udp.length = hdr.udp.length + (SUM_BYTES - IDX_BYTES);
    }

    // NORM -> NORM_RESULT in place: the payload already holds the maximum.
    action norm_to_result() {
        hdr.thc.contributors = meta.out_k;
        hdr.thc.bitmap = meta.out_bm;
        hdr.udp.checksum = 0;
        hdr.thc.type = T_NORM_RESULT;
    }

    action to_straggler() {
        bit<16> payload = hdr.thc.payload_len;
        hdr.thc.type = T_STRAGGLER;
        hdr.thc.flags = 0;
        hdr.thc.elem_bits = 0;
        hdr.thc.round = meta.cur_round;
        hdr.thc.count = 0;
        hdr.thc.payload_len = 0;
        hdr.thc.bitmap = 0;
        hdr.thc.contributors = 0;
        hdr.idx.setInvalid();
        hdr.norm.setInvalid();
        hdr.ipv4.total_len = hdr.ipv4.total_len - payload;
        hdr.udp.length = hdr.udp.length - payload;
    }

    apply {
        if (!hdr.thc.isValid()) {
            // a datagram to the THC port too short for the THC header is malformed, as the
            // software PS counts it, not L2 traffic (found by p4testgen, docs/p4.md)
            if (hdr.udp.isValid() && hdr.udp.dst_port == THC_PORT) {
                drop_with(C_MALFORMED);
                return;
            }
            if (hdr.eth.isValid()) {
                l2.apply();
            }
            return;
        }
        // ---- validation, in the software PS's order
        if (sm.parser_error != error.NoError || hdr.thc.magic != THC_MAGIC) {
            drop_with(C_MALFORMED);
            return;
        }
        if (hdr.thc.version != THC_VERSION) {
            drop_with(C_WRONG_VERSION);
            return;
        }
        if (hdr.thc.type != T_DATA && hdr.thc.type != T_NORM) {
            drop_with(C_MALFORMED);
            return;
        }
        // the job: an id no running job has counts in block 0; from here on in the job's block
        thc_config.apply();
        if (meta.configured == 0 || hdr.thc.nonce != meta.nonce) {
            drop_with(C_UNKNOWN_JOB);
            return;
        }
        if (hdr.thc.worker_id >= meta.n) {
            drop_with(C_WORKER_OUT_OF_RANGE);
            return;
        }
        workers.apply();
        if (meta.registered == 0 || meta.worker != hdr.thc.worker_id) {
            drop_with(C_UNREGISTERED);
            return;
        }
        if (hdr.thc.type == T_NORM) {
            if (hdr.thc.slot < meta.data_slots || hdr.thc.slot >= meta.data_slots + meta.norm_slots) {
                drop_with(C_SLOT_OUT_OF_RANGE);
                return;
            }
            if (hdr.thc.elem_bits != 32 || hdr.thc.op != OP_MAX_U32 || hdr.thc.count != 1 ||
                hdr.thc.payload_len != 4 || hdr.udp.length != 8 + HDR_BYTES + 4) {
                drop_with(C_MALFORMED);
                return;
            }
        } else {
            if (hdr.thc.slot >= meta.data_slots) {
                drop_with(C_SLOT_OUT_OF_RANGE);
                return;
            }
            if (hdr.thc.elem_bits != 4 || hdr.thc.op != OP_LOOKUP_SUM || hdr.thc.count != LANES ||
                hdr.thc.payload_len != IDX_BYTES || hdr.udp.length != 8 + HDR_BYTES + IDX_BYTES) {
                drop_with(C_MALFORMED);
                return;
            }
        }
        if (hdr.thc.num_workers != meta.n) {
            drop_with(C_MALFORMED);
            return;
        }
        // the slot is checked against the job's region above: now it is placed in it
        meta.slot = (bit<32>)meta.base + (bit<32>)hdr.thc.slot;

        // ---- the slot's rules
        slot_update();
        verdict_t v = meta.verdict;
        if (v == V_DROP_MALFORMED) {
            drop_with(C_MALFORMED);
            return;
        }
        if (v == V_DUP) {
            drop_with(C_DUPLICATE);
            return;
        }
        if (v == V_AHEAD) {
            drop_with(C_AHEAD);
            return;
        }
        // replies carry the job's nonce, never a token
        hdr.thc.token = 0;
        if (v == V_STALE) {
            count_event(C_STALE);
            to_straggler();
            bounce();
            return;
        }
        // ---- the lanes; reg_idx already selects the bank of the packet's round (round − 1 for RESEND_PREV)
        if (hdr.thc.type == T_DATA) {
            hdr.sums.setValid();
            if (meta.add == 1) {
$apply_lookups
            }
$apply_lanes
        } else {
            norm_lane();
        }
        if (v == V_AGG) {
            mark_to_drop(sm);
            return;
        }
        // ---- the outputs
        if (hdr.thc.type == T_DATA) {
            data_to_result();
        } else {
            norm_to_result();
        }
        if (v == V_AGG_DONE) {
            count_event(C_ROUNDS_COMPLETED);
            if (meta.cnt < meta.n) {
                count_event(C_PARTIAL_ROUNDS);
            }
            hdr.thc.worker_id = 0;
            hdr.thc.flags = 0;
            // source: the PS address the workers sent to; destinations are set per replica
            hdr.eth.src = meta.ps_mac;
            hdr.ipv4.src = hdr.ipv4.dst;
            hdr.udp.src_port = hdr.udp.dst_port;
            sm.mcast_grp = meta.group;
            return;
        }
        // V_RESEND_CUR, V_LATE, V_RESEND_PREV: unicast the kept result to the sender
        if (v == V_LATE) {
            count_event(C_LATE);
        }
        count_event(C_RESULTS_RESENT);
        hdr.thc.flags = F_RESENT;
        bounce();
    }
}
