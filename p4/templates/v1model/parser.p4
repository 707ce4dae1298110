parser ThcParser(packet_in pkt, out headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t sm) {
    state start {
        pkt.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            ETH_IPV4: ipv4;
            default: accept;
        }
    }
    state ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol) {
            IP_UDP: udp;
            default: accept;
        }
    }
    state udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            THC_PORT: thc;
            default: accept;
        }
    }
    state thc {
        pkt.extract(hdr.thc);
        transition select(hdr.thc.type) {
            T_DATA: idx;
            T_NORM: norm;
            default: accept;
        }
    }
    state idx {
        pkt.extract(hdr.idx);
        transition accept;
    }
    state norm {
        pkt.extract(hdr.norm);
        transition accept;
    }
}

control ThcVerify(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}
