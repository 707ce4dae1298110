parser ThcEgressParser(packet_in pkt, out headers_t hdr, out egress_metadata_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);        // the ingress deparser puts it in front of every packet
        transition parse_eth;
    }
$parse_states
}

control ThcEgress(inout headers_t hdr, inout egress_metadata_t meta,
                  in egress_intrinsic_metadata_t eg_intr_md,
                  in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                  inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    // each multicast replica (rid = worker id + 1) gets its worker's addresses
    action set_dest(mac_addr_t mac, ipv4_addr_t ip, bit<16> port) {
        hdr.eth.dst = mac;
        hdr.ipv4.dst = ip;
        hdr.udp.dst_port = port;
    }
#ifndef THC_TESTGEN_RECIRC_PORT
    table replica_dest {
        key = { eg_intr_md.egress_rid: exact; }
        actions = { set_dest; NoAction; }
        size = 64;
        default_action = NoAction();
    }
#endif
    apply {
        if (hdr.bridge.pass2 == 0) {
            hdr.bridge.setInvalid();    // leaving the switch: no bridge header on the wire
        }
#ifndef THC_TESTGEN_RECIRC_PORT
        if (hdr.thc.isValid() && eg_intr_md.egress_rid != 0) {
            replica_dest.apply();
        }
#endif
        // `thc p4 testgen` leaves the replicas' rewrite out: p4testgen (p4c v1.2.5.16) sends
        // no multicast replica to the egress, and a program that reads egress_rid gets its
        // egress parser's bridge header misplaced there (docs/p4.md)
    }
}

control ThcEgressDeparser(packet_out pkt, inout headers_t hdr, in egress_metadata_t meta,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_csum;
    apply {
        hdr.ipv4.hdr_checksum = ipv4_csum.update({
$ipv4_checksum_fields
        });
        pkt.emit(hdr);
    }
}

Pipeline(ThcIngressParser(), ThcIngress(), ThcIngressDeparser(),
         ThcEgressParser(), ThcEgress(), ThcEgressDeparser()) pipe;

Switch(pipe) main;
