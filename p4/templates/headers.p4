// ---- constants: the wire format (proto/headers.py) and the program's shape (p4/spec.py)
const bit<16> ETH_IPV4 = 0x0800;
const bit<8> IP_UDP = 17;
const bit<16> THC_PORT = $port;
const bit<16> THC_MAGIC = $magic;
const bit<8> THC_VERSION = $version;
$type_constants
const bit<8> F_RESENT = $f_resent;
const bit<8> OP_LOOKUP_SUM = $op_lookup_sum;
const bit<8> OP_MAX_U32 = $op_max_u32;
const bit<16> LANES = $lanes;
const bit<16> IDX_BYTES = $idx_bytes;
const bit<16> SUM_BYTES = $sum_bytes;
const bit<16> HDR_BYTES = $header_bytes;
const bit<32> ROUND_WINDOW = $round_window;

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;
typedef bit<32> round_t;
typedef bit<8> verdict_t;
typedef bit<32> event_t;

// outcomes of the slot update
$verdict_constants

// event counter indices (names as in ps_server/reference.py)
$event_constants

header ethernet_t {
    mac_addr_t dst;
    mac_addr_t src;
    bit<16> ether_type;
}

header ipv4_t {
    bit<4> version;
    bit<4> ihl;
    bit<8> diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    ipv4_addr_t src;
    ipv4_addr_t dst;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

// the THC header, field for field from proto/headers.py FIELDS
header thc_t {
$thc_fields
}

// DATA payload: LANES 4-bit table indices, the first in the high nibble
header idx_t {
$idx_fields
}

// RESULT payload: LANES 8-bit lane sums (on Tofino: 32-bit words of four lanes, the same bytes)
header sums_t {
$sum_fields
}

// NORM / NORM_RESULT payload: one order-preserving u32 code of a float32
header norm_t {
    bit<32> v;
}
