typedef bit<16> slot_index_t;
typedef bit<17> bank_index_t;   // slot ++ round parity

// how a packet's round relates to its slot's round
typedef bit<3> relation_t;
const relation_t REL_NEW = 0;
const relation_t REL_SAME = 1;
const relation_t REL_PREV = 2;
const relation_t REL_STALE = 3;
const relation_t REL_AHEAD = 4;
const relation_t REL_NONE = 7;      // not classified: the packet failed validation
// a gap below ROUND_WINDOW (a power of two) has these bits clear
const round_t GAP_SMALL_MASK = ~(ROUND_WINDOW - 1);

// the event cell of packets that only aggregate (no drop, no reply)
const event_t C_NONE = $event_cells - 1;

// A slot's contributors in one 32-bit word: count in bits 31..24, worker bitmap in bits 23..0.
const bit<32> ONE_CONTRIBUTOR = 1 << 24;

// the shadow copy of a slot's previous round: one 64-bit register cell
struct shadow_t {
    bit<32> cb;         // count << 24 | bitmap of the completed previous round (0: none)
    bit<32> offset;     // its coordinate offset
}

// What pass 1 hands to pass 2.  A THC packet that reaches its slot's state goes through the
// ingress twice: pass 1 validates it and runs the slot's round, offset, arrival, contributor
// and shadow registers; it then recirculates with this header in front of Ethernet, and
// pass 2 decides the verdict, runs the lane registers and makes the reply (p4/tofino/README.md).
// The ingress deparser emits it for every packet so that the egress parser always finds it;
// the egress removes it unless the packet is on its way to pass 2.
typedef bit<8> pass_kind_t;
const pass_kind_t K_NONE = 0;       // finished in pass 1 (dropped, or a STRAGGLER reply)
const pass_kind_t K_FIRST = 1;      // the first packet of a new round: set the lanes
const pass_kind_t K_SAME = 2;       // the slot's current round, offset checked
const pass_kind_t K_PREV = 3;       // the previous round, kept by the shadow copy

header bridge_t {
    bit<8> pass2;                   // 1: on its way to pass 2, through the recirculation port
    pass_kind_t kind;
    bit<7> pad;
    PortId_t port;                  // the port the packet first came in on (replies go there)
    bit<32> me;                     // 1 << worker id
    bit<32> cb;                     // the slot's count << 24 | bitmap: K_FIRST: the sender alone;
                                    // K_SAME: after pass 1; K_PREV: pass 2 reads the shadow copy
    bit<32> seen;                   // K_SAME: the sender's arrival bit before this packet
    bit<32> shadow_cb;              // K_FIRST: what the shadow copy keeps (0: nothing)
    bit<32> off_old;                // K_FIRST: the previous round's offset; K_PREV: the packet's
}

struct headers_t {
    bridge_t bridge;
    ethernet_t eth;
    ipv4_t ipv4;
    udp_t udp;
    thc_t thc;
    idx_t idx;
    sums_t sums;
    norm_t norm;
}

struct metadata_t {
    PortId_t reply_port;        // where a reply to the sender goes
    round_t slot_round;         // the slot's round, for a STRAGGLER notification
    // the job (thc_job: job id and nonce are its key), its worker ids and slots
    bit<1> job_ok;
    bit<1> n_ok;                // job_size: the packet's num_workers is the job's n
    PortId_t recirc_port;       // the recirculation port that takes pass 1 to pass 2
    bit<8> n;
    bit<8> quorum;
    bit<32> quorum_cb;          // quorum << 24
    mac_addr_t ps_mac;
    bit<1> worker_ok;
    bit<1> slot_ok;
    bit<1> shape_ok;            // DATA or NORM with that type's element width, op, count and lengths
    // the sender (workers: source address, port and token are the key)
    bit<1> registered;          // source, port, token and worker id are a registration
    bit<32> me;                 // 1 << worker
    bit<32> me_cb;              // ONE_CONTRIBUTOR | me
    // the slot's rules
    round_t round_plus_one;
    round_t last;               // the slot's round + 1 before this packet (0: slot not used yet)
    round_t diff;               // packet round − slot round (mod 2^32)
    round_t gap;                // packet round − (slot round + 1), 0 when that is negative
    bit<1> far;                 // round > ROUND_WINDOW: round_far decides the slot
    bit<1> next_round;          // the packet starts the round right after the slot's
    relation_t rel;
    bit<32> off_diff;           // the slot's offset − the packet's (0: the same)
    bit<32> mine;               // bridge.cb & bridge.me
    bit<8> count;               // cb's count (bits 31..24)
    bit<8> quorum_short;        // quorum |-| count: contributors still missing to the quorum
    bit<8> n_short;             // n |-| count: contributors still missing to n
    bit<1> first;
    verdict_t verdict;
    bank_index_t bank_idx;      // 2 · slot + round parity
    event_t event;
    event_t extra_event;
    // per 32-bit word: the table values of four lanes
$input_fields
}

struct egress_metadata_t {
}
