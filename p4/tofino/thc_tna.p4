// THC aggregation for Intel Tofino (TNA) — a design sketch in P4_16.
//
// NOT COMPILED: bf-p4c and the Tofino SDE are proprietary and not available here, so this
// file has never been through a compiler.  It shows how p4/thc.p4 (which is compiled and
// tested under bmv2) maps onto Tofino's constraints; see p4/tofino/README.md for the stage
// and resource budget.  The wire format is proto/headers.py.
//
// Structure (THC paper §7: lookup in a table, then recirculation to the registers):
//   pass 0 (ingress):  parse 32 four-bit indices; 32 lookup tables (one per lane, 16 entries,
//                      filled from T) write 32 eight-bit table values into a bridged header;
//                      the slot state machine runs in one RegisterAction per state register.
//   recirculate:       the packet, now carrying table values instead of indices, re-enters.
//   pass 1 (ingress):  32 lane RegisterActions add (or overwrite on a new round, or read for a
//                      resend) the values into register banks indexed by 2·slot + round parity.
//   egress:            multicast replicas get per-worker addresses (egress_rid → worker).
#include <core.p4>
#include <tna.p4>

#define SLOTS 4096
#define LANE(i) \
    Register<bit<8>, bit<32>>(2 * SLOTS) acc##i; \
    RegisterAction<bit<8>, bit<32>, bit<8>>(acc##i) add##i = { \
        void apply(inout bit<8> v, out bit<8> out_v) { v = v + hdr.vals.v##i; out_v = v; } }; \
    RegisterAction<bit<8>, bit<32>, bit<8>>(acc##i) set##i = { \
        void apply(inout bit<8> v, out bit<8> out_v) { v = hdr.vals.v##i; out_v = v; } }; \
    RegisterAction<bit<8>, bit<32>, bit<8>>(acc##i) read##i = { \
        void apply(inout bit<8> v, out bit<8> out_v) { out_v = v; } };

#define LUT(i) \
    action set_v##i(bit<8> v) { hdr.vals.v##i = v; } \
    table lut##i { key = { hdr.idx.z##i : exact; } actions = { set_v##i; } size = 16; }

header thc_t {
    bit<16> magic; bit<8> version; bit<8> type; bit<8> flags; bit<8> worker_id;
    bit<8> num_workers; bit<8> elem_bits; bit<16> job_id; bit<16> slot; bit<32> round;
    bit<32> offset; bit<16> count; bit<16> payload_len; bit<32> bitmap; bit<8> contributors;
    bit<8> op; bit<16> reserved;
}
// ... idx_t (32 × bit<4>), vals_t (32 × bit<8>), ethernet/ipv4/udp as in p4/thc.p4 ...

// Slot state: Tofino allows one RegisterAction per register per pass, each with a small
// ALU program on a 32-bit (or paired 2×32-bit) cell.  The bmv2 program's single action
// becomes one register per state word, evaluated in dependency order across stages:
//   round_reg   : RegisterAction returns the relation of pkt.round to the stored round
//                 (newer → store, same, older-by-one, stale) as a 2-bit code;
//   bitmap_reg  : on "newer" store the sender's bit, on "same" OR it in and return the old
//                 value (duplicate test = old & bit);
//   count_reg   : paired with the quorum: on "newer" store 1, on "same and not duplicate"
//                 increment, return the new count (completion = count == quorum);
//   prev_*      : shadow-copy metadata, written when "newer" and the old round completed.
// Tofino cannot branch between stages inside one action, so each RegisterAction reads the
// code produced by the previous stage's RegisterAction from metadata.

control ThcIngress(inout headers_t hdr, inout metadata_t meta,
                   in ingress_intrinsic_metadata_t ig_md,
                   in ingress_intrinsic_metadata_from_parser_t prs_md,
                   inout ingress_intrinsic_metadata_for_deparser_t dprs_md,
                   inout ingress_intrinsic_metadata_for_tm_t tm_md) {
    LUT(0) LUT(1) LUT(2) LUT(3) LUT(4) LUT(5) LUT(6) LUT(7)
    LUT(8) LUT(9) LUT(10) LUT(11) LUT(12) LUT(13) LUT(14) LUT(15)
    LUT(16) LUT(17) LUT(18) LUT(19) LUT(20) LUT(21) LUT(22) LUT(23)
    LUT(24) LUT(25) LUT(26) LUT(27) LUT(28) LUT(29) LUT(30) LUT(31)
    LANE(0) LANE(1) LANE(2) LANE(3) LANE(4) LANE(5) LANE(6) LANE(7)
    LANE(8) LANE(9) LANE(10) LANE(11) LANE(12) LANE(13) LANE(14) LANE(15)
    LANE(16) LANE(17) LANE(18) LANE(19) LANE(20) LANE(21) LANE(22) LANE(23)
    LANE(24) LANE(25) LANE(26) LANE(27) LANE(28) LANE(29) LANE(30) LANE(31)

    apply {
        if (hdr.idx.isValid()) {
            // pass 0: indices → table values, then recirculate
            lut0.apply(); lut1.apply(); /* … lut31 … */
            hdr.idx.setInvalid();
            hdr.vals.setValid();
            tm_md.ucast_egress_port = meta.recirc_port;
        } else if (hdr.vals.isValid()) {
            // pass 1: slot state machine (round/bitmap/count RegisterActions), then per lane:
            //   first packet of a round → set##i.execute(idx); later → add##i.execute(idx);
            //   resend verdicts → read##i.execute(idx) on the kept (or shadow) bank
            // completion → tm_md.mcast_grp_a = 1; resends/stragglers → back to the sender.
        }
    }
}
