/* UDP GRO/GSO constants for the C data path (ps_server/_fastpath.c, worker/_batchio.c) and
 * the benchmark blaster (bench/_udpbench.c); proto/udpio.py is the Python side.  Defined
 * here for C libraries whose headers predate them (Linux 4.18 / 5.0). */
#ifndef THC_UDPIO_H
#define THC_UDPIO_H
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#define GSO_MAX_SEGS 64          /* UDP_MAX_SEGMENTS of older kernels */
#define GSO_MAX_BYTES 65000
#define CMSG_SEG_SPACE CMSG_SPACE(sizeof(uint16_t))
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

/* Make message h a GSO message of `seg`-byte datagrams, its control message in cb
 * (CMSG_SEG_SPACE bytes). */
static inline void set_gso_segment(struct msghdr *h, void *cb, uint32_t seg) {
    h->msg_control = cb;
    h->msg_controllen = CMSG_SEG_SPACE;
    struct cmsghdr *c = CMSG_FIRSTHDR(h);
    c->cmsg_level = SOL_UDP; c->cmsg_type = UDP_SEGMENT; c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    uint16_t s16 = (uint16_t)seg;
    memcpy(CMSG_DATA(c), &s16, sizeof s16);
}
#endif
