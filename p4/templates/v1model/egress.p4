control ThcEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    // each multicast replica (one rid per job and rank, from the control plane) gets its worker's addresses
    action set_dest(mac_addr_t mac, ipv4_addr_t ip, bit<16> port) {
        hdr.eth.dst = mac;
        hdr.ipv4.dst = ip;
        hdr.udp.dst_port = port;
    }
    table replica_dest {
        key = { sm.egress_rid: exact; }
        actions = { set_dest; NoAction; }
        size = $max_members;
        default_action = NoAction();
    }
    apply {
        if (hdr.thc.isValid() && sm.egress_rid != 0) {
            replica_dest.apply();
        }
    }
}

control ThcComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid(), {
$ipv4_checksum_fields
        }, hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

control ThcDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.eth);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.thc);
        pkt.emit(hdr.idx);
        pkt.emit(hdr.sums);
        pkt.emit(hdr.norm);
    }
}

V1Switch(ThcParser(), ThcVerify(), ThcIngress(), ThcEgress(), ThcComputeChecksum(), ThcDeparser()) main;
