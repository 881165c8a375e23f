from mapl_swarm.cli import main
import sys
sys.exit(main())
