/*
 * crab-init: pid 1 of a Crab sandbox.
 *
 * It does one thing: reap every child that is re-parented to it, forever, without busy
 * waiting. It holds no files open (stdio is /dev/null inside the sandbox), so CRIU can dump and
 * restore it like any other task. It is linked statically so it runs on any image.
 */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>

static void on_chld(int sig) { (void)sig; }

int main(void) {
    sigset_t chld, empty;
    struct sigaction sa = {0};
    sa.sa_handler = on_chld;
    sigaction(SIGCHLD, &sa, 0);
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigemptyset(&empty);
    sigprocmask(SIG_BLOCK, &chld, 0);
    for (;;) {
        while (waitpid(-1, 0, WNOHANG) > 0) {
        }
        sigsuspend(&empty);
    }
}
