parser ThcParser(packet_in pkt, out headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t sm) {
    state start {
        transition parse_eth;
    }
$parse_states
}

control ThcVerify(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}
