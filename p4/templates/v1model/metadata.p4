struct headers_t {
    ethernet_t eth;
    ipv4_t ipv4;
    udp_t udp;
    thc_t thc;
    idx_t idx;
    sums_t sums;
    norm_t norm;
}

struct metadata_t {
    // the job (thc_config)
    bit<32> nonce;
    bit<8> n;
    bit<8> quorum;
    bit<16> base;
    bit<16> data_slots;
    bit<16> norm_slots;
    bit<16> group;
    event_t event_base;
    mac_addr_t ps_mac;
    bit<32> epoch;
    bit<1> configured;
    // the packet's slot in the registers (base + slot)
    bit<32> slot;
    // the sender (workers)
    bit<8> worker;
    bit<1> registered;
    // the slot update's outcome
    verdict_t verdict;
    bit<1> first;
    bit<1> add;
    bit<32> reg_idx;
    round_t cur_round;
    bit<8> cnt;
    bit<32> bm;
    bit<8> out_k;
    bit<32> out_bm;
    // table values of this packet's indices
$value_fields
}
